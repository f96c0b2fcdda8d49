"""``PipelineStrategy(plan="auto")``: measure, plan on one rank, and give every rank the choice.

Global rank 0 profiles the layers once per candidate micro-batch count (the run's first batch,
as for ``balance="time"``); ranks 0 and 1 time point-to-point transfers between them; rank 0
plans (:mod:`lightning_pipe.plan.planner`) and broadcasts the ranked candidates, so every rank
runs the same first choice.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_pipe.partition.costs import Profile
from lightning_pipe.partition.profile import agreed_profile
from lightning_pipe.plan.planner import Candidate, Link, plan


def measure_link(device: torch.device, nbytes: int, repeats: int = 5) -> Optional[Link]:
    """Latency and bandwidth between global ranks 0 and 1 from round trips of a 4-byte and an
    ``nbytes`` message (half a round trip each); every rank calls it, ranks 0 and 1 take part,
    the others return None. A world of one process has no link (None)."""
    if not dist.is_initialized() or dist.get_world_size() < 2 or dist.get_rank() > 1:
        return None
    rank = dist.get_rank()

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
    bandwidth = nbytes / max(large - small, 1e-9)
    return Link(latency=small, bandwidth=bandwidth)


def agreed_plan(
    is_source: bool,
    broadcast: Callable[[Any], Any],
    profiles: Callable[[], dict[int, Profile]],
    link: Callable[[int], Optional[Link]],
    num_stages: int,
    memory_budget: Optional[int],
) -> tuple[list[Candidate], Link, dict[int, Profile]]:
    """Profiles measured on the source rank, the link measured by ranks 0 and 1 with the largest
    activation the profiles saw, the ranked candidates computed on the source rank: the same on
    every rank (a failure while measuring is raised on every rank)."""
    measured: dict[int, Profile] = {}

    def measure() -> Profile:
        measured.update(profiles())
        return next(iter(measured.values()))

    agreed_profile(is_source, broadcast, measure)  # profiles (or the failure) reach every rank
    largest = broadcast(max((c.output_bytes for p in measured.values() for c in p.layers), default=0) if is_source else None)
    found = link(max(int(largest), 1 << 16))
    found = broadcast(found if is_source else None)
    if found is None:
        found = Link(latency=0.0, bandwidth=float("inf"))
    ranked = plan(measured, num_stages, found, memory_budget) if is_source else None
    ranked, measured_all = broadcast((ranked, measured if is_source else None))
    return ranked, found, measured_all




def plan_for_strategy(strategy: Any, module: Any, layers: torch.nn.Sequential) -> tuple[list[Candidate], Link, dict[int, Profile]]:
    """Measure and plan for a ``PipelineStrategy`` in its setup, before the split (see the module
    docstring); returns what :func:`agreed_plan` returns."""
    from lightning_pipe.partition.profile import first_batch, profile_module
    from lightning_pipe.plan.planner import chunk_candidates
    from lightning_pipe.runtime.microbatch import batch_size

    trainer = module.trainer
    home = next((t.device for t in module.state_dict().values()), torch.device("cpu"))
    cache: list[Any] = []

    def batch() -> Any:  # drawn once, inside the first profile's saved random state
        if not cache:
            cache.append(strategy.batch_to_device(first_batch(trainer), home))
        return cache[0]

    def profiles() -> dict[int, Profile]:
        context = strategy.precision_plugin.train_step_context
        found = {1: profile_module(module, layers, batch, 1, strategy.root_device, context)}
        for chunks in chunk_candidates(batch_size(cache[0]))[1:]:
            found[chunks] = profile_module(module, layers, batch, chunks, strategy.root_device, context)
        return found

    device = strategy.root_device
    budget = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    return agreed_plan(
        strategy.global_rank == 0, strategy.broadcast, profiles, lambda n: measure_link(device, n), strategy.num_stages, budget
    )


__all__ = ["agreed_plan", "measure_link", "plan_for_strategy"]
