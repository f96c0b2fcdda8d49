"""``PipelineStrategy(plan="auto")``: measure, plan on one rank, and give every rank the choice.

Global rank 0 profiles the layers once per candidate micro-batch size (from the run's first
batch, as for ``balance="time"``); every rank times a fixed probe on its own device (unless
``rank_speeds`` gives the speeds) and reads its free memory, gathered to all; ranks 0 and 1 time
point-to-point transfers between them; rank 0 plans (:mod:`lightning_pipe.plan.planner`, each
stage's compute scaled by its rank's speed) and broadcasts the ranked candidates, so every rank
runs the same first choice.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.config import PipelineConfig
from lightning_pipe.partition.measure.measured import MeasureInputs, agreed_resources
from lightning_pipe.partition.measure.profile import agreed_profile
from lightning_pipe.partition.solvers.costs import Profile
from lightning_pipe.plan.planner import Candidate, Link, activations_line, format_plans, plan
from lightning_pipe.plan.report import link_line
from lightning_pipe.runtime.topology import Layout
from lightning_pipe.schedules import traits


def measure_link(device: torch.device, nbytes: int, repeats: int = 5) -> Link | None:
    """Latency and bandwidth between global ranks 0 and 1 from round trips of a 4-byte and an
    ``nbytes`` message (half a round trip each); every rank calls it, ranks 0 and 1 take part,
    the others return None. A world of one process has no link (None). The bandwidth is infinite
    where the large message took no longer than the small one."""
    if not dist.is_initialized() or dist.get_world_size() < 2 or dist.get_rank() > 1:
        return None
    rank = dist.get_rank()
    if dist.get_backend() != "nccl":  # gloo sends host memory (the pipeline stages GPU tensors through it too)
        device = torch.device("cpu")

    def one_way(size: int) -> float:
        buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        times = []
        for rep in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            else:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rep > 0:
                times.append((time.perf_counter() - start) / 2)
        return statistics.median(times)

    small = one_way(4)
    large = one_way(nbytes)
    # a large message no slower than the small one (a busy host's scheduling outweighs the copy): the
    # bandwidth is beyond what this measures, and transfers are predicted to cost the latency only
    bandwidth = nbytes / (large - small) if large > small else float("inf")
    return Link(latency=small, bandwidth=bandwidth)


def measure_copy(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of an offload copy of ``nbytes``: from the device to pinned host memory on a
    GPU (on the copy's own stream, waited for), host to host on CPU (as offload copies there); the
    median of ``repeats``, infinite where the copy took no measurable time."""
    source = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    host = torch.empty(source.shape, dtype=torch.float32, pin_memory=device.type == "cuda")
    times = []
    for rep in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        host.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep > 0:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return source.numel() * 4 / seconds if seconds > 0 else float("inf")


def agreed_plan(
    is_source: bool,
    broadcast: Callable[[Any], Any],
    profiles: Callable[[], dict[int, Profile]],
    link: Callable[[int], Link | None],
    rank: Callable[[dict[int, Profile], Link], list[Candidate]],
) -> tuple[list[Candidate], Link, dict[int, Profile]]:
    """Profiles (by micro-batch size) measured on the source rank, the link measured by ranks 0
    and 1 with the largest activation the profiles saw, the candidates ranked by ``rank`` on the
    source rank: the same on every rank (a failure while measuring is raised on every rank)."""
    measured: dict[int, Profile] = {}

    def measure() -> Profile:
        measured.update(profiles())
        return next(iter(measured.values()))

    agreed_profile(is_source, broadcast, measure)  # profiles (or the failure) reach every rank
    largest = broadcast(
        max((c.output_bytes for p in measured.values() for c in p.layers), default=0) if is_source else None
    )
    found = link(max(int(largest), 1 << 16))
    found = broadcast(found if is_source else None)
    if found is None:
        found = Link(latency=0.0, bandwidth=float("inf"))
    ranked = rank(measured, found) if is_source else None
    ranked, measured_all = broadcast((ranked, measured if is_source else None))
    return ranked, found, measured_all


def plan_layers(
    config: PipelineConfig,
    layout: Layout,
    module: Any,
    layers: torch.nn.Sequential | torch.nn.ModuleList,
    inputs: MeasureInputs,
    say: Callable[[str], None] = print,
) -> tuple[list[Candidate], Link, dict[int, Profile]]:
    """Measure and plan in the pipeline's setup, before the split (see the module docstring);
    returns what :func:`agreed_plan` returns, the profiles keyed by micro-batch size.

    The run's own ``layout`` (its stages x replicas, each replica reading the DataLoader's
    batch) is planned for, unless ``config.plan_all_layouts``: then every stages x replicas of the
    world is ranked for the same global batch (DataLoader batch x the layout's replicas), each
    replica reading ``global batch / replicas`` (what ``lightning-pipe plan`` prints; micro-batches
    larger than the DataLoader's batch cannot be measured from it and are left out)."""
    from lightning_pipe.partition.measure.profile import Timing, profile_module
    from lightning_pipe.plan.planner import PLAN_SCHEDULES, chunk_candidates, needed_sizes, plan_layouts
    from lightning_pipe.runtime.microbatch import batch_size

    # a block container (the model's forward loops over its blocks): the schedules that run one (all of today's)
    schedules = (
        PLAN_SCHEDULES
        if isinstance(layers, torch.nn.Sequential)
        else tuple(s for s in PLAN_SCHEDULES if traits(s).block_containers)
    )

    all_layouts = config.plan_all_layouts
    cache: list[Any] = []
    stages, replicas = layout.stages, layout.replicas
    device = inputs.device

    def batch() -> Any:  # drawn once, inside the first profile's saved random state
        if not cache:
            cache.append(inputs.batch())
        return cache[0]

    def sizes(per_replica: int) -> list[int]:
        if all_layouts:
            return [n for n in needed_sizes(stages * replicas, per_replica * replicas) if n <= per_replica]
        return sorted({-(-per_replica // m) for m in chunk_candidates(per_replica)}, reverse=True)

    def profiles() -> dict[int, Profile]:
        found: dict[int, Profile] = {}
        timing = Timing(context=inputs.context)
        first = profile_module(module, layers, batch, 1, device, timing, optimizers=inputs.optimizers)
        per_replica = batch_size(cache[0])
        found[first.microbatch_size] = first
        for size in sizes(per_replica):
            if size not in found:
                profile = profile_module(
                    module, layers, batch, -(-per_replica // size), device, timing, optimizers=inputs.optimizers
                )
                found[profile.microbatch_size] = profile
        return found

    def rank(measured: dict[int, Profile], link: Link) -> list[Candidate]:
        per_replica = max(measured)  # the whole DataLoader batch (the first profile, one micro-batch)
        # what one offloaded micro-batch's copy costs: the largest layer's saved activations, at least 1 MiB
        saved = max((c.activation_bytes for p in measured.values() for c in p.layers), default=0)
        copy = measure_copy(device, max(saved, 1 << 20)) if budget is not None else float("inf")
        if all_layouts:
            return plan_layouts(
                measured, stages * replicas, per_replica * replicas, link, budget, schedules, rendezvous=rendezvous,
                rank_speeds=speeds, rank_order=fixed, copy_bandwidth=copy, offload=offload,
            )  # fmt: skip
        sizes = {m: -(-per_replica // m) for m in chunk_candidates(per_replica)}
        by_chunks = {m: measured[n] for m, n in sizes.items() if n in measured}
        return plan(
            by_chunks,
            stages,
            link,
            budget,
            schedules,
            replicas=replicas,
            replica_batch=per_replica,
            rendezvous=rendezvous,
            rank_speeds=speeds,
            rank_order=fixed,
            copy_bandwidth=copy,
            offload=offload,
        )

    rendezvous = dist.is_initialized() and dist.get_backend() == "nccl"  # as the pipeline validates schedules
    offload = config.data_parallel != "shard"  # FSDP2's sharded weights and offload's hooks: refused together
    cuda = device.type == "cuda"
    resources = agreed_resources(inputs.gather, device, config.rank_speeds, stages * replicas, True, cuda)
    speeds = resources.speeds
    fixed = layout.order if config.rank_order is not None else None  # else the speeds place the ranks
    if inputs.is_source and speeds is not None:
        say(f"lightning-pipe plan: {resources.describe()}")
    # every rank's own free memory bounds the stages it holds (on a CPU host: no budget), unless memory_budget is given
    free = resources.known_free
    budget: int | list[int] | None = None
    given = config.memory_budget
    if given is not None:  # the user's, for every rank or per global rank
        budget = given if isinstance(given, int) else [int(b) for b in given]
        if isinstance(budget, list) and len(budget) != stages * replicas:
            raise ValueError(
                f"PipelineStrategy(memory_budget={list(budget)}) gives {len(budget)} budgets for {stages * replicas} "
                "processes. Give one per process (global rank 0 first), or one integer for all of them."
            )
    elif cuda:
        budget = [int(f) for f in free] if free is not None else int(torch.cuda.mem_get_info(device)[0])
    return agreed_plan(inputs.is_source, inputs.broadcast, profiles, lambda n: measure_link(device, n), rank)


def apply_plan(
    config: PipelineConfig,
    layout: Layout,
    module: Any,
    layers: torch.nn.Sequential | torch.nn.ModuleList,
    inputs: MeasureInputs,
    say: Callable[[str], None] = print,
) -> tuple[PipelineConfig, Profile, list[Candidate]]:
    """``plan="auto"``: ``config`` with the schedule, chunks, recompute mode, virtual stages and
    balance of the planner's first choice (the same on every rank) for the run's own stages x
    replicas, which stay fixed (the global batch is the DataLoader's batch x replicas, see
    docs/planner.md); with the profile of that choice's micro-batch size and the ranked candidates.
    ``say`` shows rank 0's lines (the trainer side passes Lightning's ``rank_zero_info``, so they appear
    with Lightning's own setup lines without any logging set-up)."""
    ranked, link, profiles = plan_layers(config, layout, module, layers, inputs, say)
    best = next(c for c in ranked if (c.depth, c.replicas) == (layout.stages, layout.replicas))
    planned = config.replace(
        schedule=best.schedule, chunks=best.chunks,
        recompute=best.recompute if isinstance(best.recompute, str) else list(best.recompute),
        offload=list(best.offload) if best.offload else False,
        virtual_stages=best.virtual_stages, balance=list(best.balance),
        rank_order=list(best.rank_order) or None,  # a given order was planned as given
    )  # fmt: skip
    if inputs.is_source and not config.plan_all_layouts:  # `lightning-pipe plan` prints the ranking itself
        say(
            f"lightning-pipe plan: {link_line(link)}; best of {len(ranked)} layouts:\n{format_plans(ranked)}\n"
            + activations_line(best)
        )
    return planned, profiles[best.microbatch_size], ranked
