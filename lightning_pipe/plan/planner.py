"""Choose stages x replicas, the schedule, ``chunks``, ``balance`` and ``recompute`` mode from measurements.

Pure: it takes a profile of the layers per micro-batch size (so each micro-batch size is measured,
not extrapolated) and the measured point-to-point link, and predicts for every combination:

- the step time: the schedule simulated with each stage's forward, B and W seconds per
  micro-batch (B and W measured apart for the schedules that split the backward; the others run
  B + W as one backward), a transfer (latency + bytes / bandwidth) added to the action that
  produces it where the next stage sits on another rank, then the gradient all-reduce over the
  replicas (a ring: ``2 (R - 1)`` transfers of ``1 / R`` of each rank's gradient bytes over the
  same measured link, started after the rank's last backward and not overlapped with it) and the
  slowest rank's optimizer step;
- the bubble: the share of rank-time the simulation leaves idle;
- the peak memory of each rank: parameters, gradients, optimizer state and the activations of
  the micro-batches the schedule holds in flight there, summed over the rank's stages;
- under a memory budget, each stage's activation policy (keep, recompute, or offload keeping ``k``
  micro-batches on the device) chosen with the split, and each stage's predicted peak of saved
  activations (:mod:`lightning_pipe.plan.activations`).

Layouts: ``S`` stages x ``R = N / S`` replicas of a world of ``N`` processes share a global batch,
``batch / R`` samples per replica split into ``chunks`` micro-batches. Schedules with several
stages per rank (``interleaved_1f1b`` and ``interleaved_zero_bubble`` with ``v`` in 2..4, ``zbv`` and
``dualpipev`` with 2) split the layers into ``S x v`` stages placed as the runtime places them;
DualPipeV is a candidate from ``chunks = 2 x processes`` on; Chimera (each stage on two ranks) on an even
number of stages from 4 on, without replicas (on 2 each process holds the whole model: see
:attr:`~lightning_pipe.schedules.traits.ScheduleTraits.planned_from`).

Candidates whose largest rank exceeds the memory budget are ranked after those that fit. Only
the synchronous schedules are candidates: the asynchronous ones train with delayed gradients,
which is the user's choice to make, not a speed setting. The framework's per-step work (the
Trainer's loop, logging, sharing the loss) is not in the prediction.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from lightning_pipe.partition.solvers.balance import balance_by_cost, balance_uniform
from lightning_pipe.partition.solvers.costs import Profile
from lightning_pipe.partition.solvers.rank_order import BalanceTarget, measured_order
from lightning_pipe.partition.solvers.speeds import all_equal, position_values, stage_values
from lightning_pipe.plan.activations import (
    OffloadReplay,
    StagePolicy,
    StagePrediction,
    choose_policies,
    offload_replays,
    predict_stage,
    stage_layers,
    stage_options,
)
from lightning_pipe.runtime.topology import Layout
from lightning_pipe.schedules import (
    DEFAULT_SCHEDULE,
    TRAITS,
    VIRTUAL_STAGES,
    DeadlockError,
    Schedule,
    build,
    peak_in_flight,
    simulate,
    stage_positions,
    traits,
)
from lightning_pipe.schedules.traits import stage_counts

PLAN_SCHEDULES = tuple(name for name, t in TRAITS.items() if t.planned)
PLAN_BALANCES = ("uniform", "parameters", "time", "memory")
PLAN_CHECKPOINTS = ("never", "except_last", "always")
PLAN_VIRTUAL = (2, 3, 4)  # stages per rank tried for the interleaved schedules


@dataclass(frozen=True)
class Link:
    """A point-to-point link between neighbouring stages, as measured."""

    latency: float  # seconds per transfer
    bandwidth: float  # bytes per second

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0

    def all_reduce_seconds(self, nbytes: int, replicas: int) -> float:
        """A ring all-reduce of ``nbytes`` over ``replicas``: ``2 (R - 1)`` steps of ``nbytes / R``."""
        if replicas <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (replicas - 1)
        return steps * self.latency + steps / replicas * nbytes / self.bandwidth


@dataclass(frozen=True)
class Candidate:
    """One layout and its prediction."""

    schedule: str
    chunks: int
    balance_mode: str  # the first balance mode that gave this split
    balance: tuple[int, ...]  # layers per stage (stages x virtual_stages of them)
    recompute: str | tuple[str, ...]  # activation recomputation: "always", "except_last", "never", or one per stage
    step_seconds: float
    bubble: float
    stage_bytes: tuple[int, ...]  # peak bytes per rank of one pipeline (its stages together)
    fits: bool
    stage_costs: tuple[tuple[float, ...], ...] = ()  # per stage (forward, B, W) seconds per micro-batch
    stages: int = 0  # pipeline depth (ranks per pipeline); 0: len(stage_bytes)
    replicas: int = 1
    virtual_stages: int = 1
    microbatch_size: int = 0
    all_reduce_seconds: float = 0.0  # the slowest rank's gradient all-reduce over the replicas
    replica_batch: int = 0  # samples per replica and step (each replica's DataLoader batch); 0: not known
    rendezvous: bool = False  # planned under NCCL's point-to-point model (its schedule regrouped where needed)
    link: Link | None = None  # the measured link the prediction used
    rank_speeds: tuple[float, ...] = ()  # per global rank, relative to the profiling rank 0; (): not known
    rank_order: tuple[int, ...] = ()  # which rank holds which slot (stage 0's replicas first); (): rank r slot r
    rank_free: tuple[int, ...] = ()  # bytes free per global rank, where the budget was given per rank; (): not
    offload: tuple[int | None, ...] = ()  # per stage, the micro-batches it keeps on the device (None: all); (): none
    activation_bytes: tuple[int, ...] = ()  # per stage, the saved activations on the device at its peak
    host_bytes: tuple[int, ...] = ()  # per stage, the saved activations in host memory at its peak

    @property
    def policies(self) -> tuple[StagePolicy, ...]:
        """Per stage (stages x virtual_stages), its activation policy."""
        n = len(self.balance)
        modes = (self.recompute,) * n if isinstance(self.recompute, str) else self.recompute
        keeps = self.offload or (None,) * n
        return tuple(StagePolicy(m, k) for m, k in zip(modes, keeps))

    @property
    def depth(self) -> int:
        return self.stages or len(self.stage_bytes)

    def strategy_arguments(self) -> dict[str, object]:
        """The ``PipelineStrategy`` arguments that run this candidate (with replicas, each replica's
        DataLoader batch must be ``batch / replicas`` for the global batch planned for)."""
        args: dict[str, object] = {
            "schedule": self.schedule,
            "chunks": self.chunks,
            "balance": list(self.balance),
            "recompute": self.recompute if isinstance(self.recompute, str) else list(self.recompute),
        }
        if self.offload:
            args["offload"] = list(self.offload)
        if self.schedule in VIRTUAL_STAGES:
            args["virtual_stages"] = self.virtual_stages
        if self.replicas > 1:
            args["stages"] = self.depth
        if self.rank_order:
            args["rank_order"] = list(self.rank_order)
        return args


def stage_ranks(schedule: str, num_ranks: int, virtual_stages: int) -> list[int]:
    """The rank of each of the ``num_ranks x virtual_stages`` stages, as the runtime places them
    (:func:`lightning_pipe.schedules.stage_positions`)."""
    return stage_positions(schedule, num_ranks, virtual_stages)


def _split(
    profile: Profile,
    mode: str,
    num_stages: int,
    in_flight: Sequence[int],
    checkpoint: str,
    speeds: Sequence[float] | None = None,
    capacities: Sequence[float] | None = None,
) -> list[int]:
    if mode == "uniform":
        return balance_uniform(len(profile.layers), num_stages)
    if mode == "parameters":
        return balance_by_cost([float(c.parameter_bytes) for c in profile.layers], num_stages)
    if mode == "time":
        return profile.balance(mode, num_stages, in_flight, checkpoint, speeds=speeds)
    return profile.balance(mode, num_stages, in_flight, checkpoint, capacities=capacities)


def stage_seconds(
    profile: Profile,
    balance: Sequence[int],
    checkpoint: str | Sequence[str],
    chunks: int,
    link: Link,
    ranks: Sequence[int] | None = None,
    speeds: Sequence[float] | None = None,
) -> list[tuple[float, float, float]]:
    """Each stage's (forward, B, W) seconds per micro-batch, its transfers included: the forward
    sends the stage's output on, B sends the gradient of its input back (latency + bytes /
    bandwidth, where the neighbouring stage is on another rank of ``ranks``; default: one stage
    per rank), and the receiving end of each transfer pays the latency too (taking a message in
    costs its rank time as well). A recomputed forward is part of B (``checkpoint``: one mode, or
    one per stage). Without a split measurement W is 0 and B the whole backward. ``speeds``: per
    stage, its rank's speed relative to the profiling rank (its compute takes the profile's seconds /
    speed; transfers are the link's)."""
    ranks = list(ranks) if ranks is not None else list(range(len(balance)))
    speeds = list(speeds) if speeds is not None else [1.0] * len(balance)
    costs: list[tuple[float, float, float]] = []
    start = 0
    modes = [checkpoint] * len(balance) if isinstance(checkpoint, str) else list(checkpoint)
    for stage, count in enumerate(balance):
        recompute = {"never": 0.0, "always": 1.0, "except_last": (chunks - 1) / chunks}[modes[stage]]
        layers = profile.layers[start : start + count]
        forward = sum(c.forward for c in layers)
        splits = [c.split_backward for c in layers]
        b = (sum(x for x, _ in splits) + recompute * forward) / speeds[stage]
        w = sum(y for _, y in splits) / speeds[stage]
        forward /= speeds[stage]
        if stage < len(balance) - 1 and ranks[stage + 1] != ranks[stage]:
            forward += link.seconds(layers[-1].output_bytes)  # sends its output
            b += link.latency  # receives the gradient of its output
        if stage > 0 and ranks[stage - 1] != ranks[stage]:
            b += link.seconds(layers[0].input_bytes)  # sends the gradient of its input
            forward += link.latency  # receives its input
        costs.append((forward, b, w))
        start += count
    return costs


def _per_stage(profile: Profile, balance: Sequence[int], field: str) -> list[float]:
    """The sum of one :class:`LayerCost` field over each stage's layers."""
    out, start = [], 0
    for count in balance:
        out.append(float(sum(getattr(c, field) for c in profile.layers[start : start + count])))
        start += count
    return out


def stage_updates(profile: Profile, balance: Sequence[int], speeds: Sequence[float] | None = None) -> list[float]:
    """Seconds of each stage's optimizer step (the stages step at once, after their last backward), on
    ranks of ``speeds`` (per stage, relative to the profiling rank; default 1.0)."""
    seconds = _per_stage(profile, balance, "update")
    return seconds if speeds is None else [t / v for t, v in zip(seconds, speeds)]


def holder_speeds(
    rank_speeds: Sequence[float] | None, stages: int, replicas: int, ranks: Sequence[int], order: Sequence[int] = ()
) -> list[float] | None:
    """The speed of the position holding each stage of ``ranks`` (the slowest of its replicas, the
    ranks placed by ``order``), from per-global-rank speeds; None where they all equal the profiling
    rank's (:func:`~lightning_pipe.partition.solvers.speeds.all_equal`)."""
    if rank_speeds is None:
        return None
    per_position = position_values(rank_speeds, stages, replicas, order)
    # None only where every position runs at the profiling rank's speed: positions equally slow (each
    # with a slow replica) still take longer than the profile says
    return None if all_equal([*per_position, 1.0]) else [per_position[r] for r in ranks]


def _copy(speeds: Sequence[float] | None, copy: int, split: int) -> list[float] | None:
    """Copy ``copy``'s stages' entries of per-holder ``speeds`` (Chimera keeps each stage twice)."""
    return None if speeds is None else list(speeds[copy * split : (copy + 1) * split])


#: bytes of memory for every rank, or per global rank; None: no limit
Budget = int | Sequence[int] | None


def position_budgets(budget: Budget, stages: int, replicas: int, order: Sequence[int] = ()) -> list[int] | None:
    """Per pipeline position, the bytes its ranks have (the least of its replicas', ranks placed by
    ``order``), from one budget for every rank or one per global rank; None: no limit."""
    if budget is None:
        return None
    if isinstance(budget, int):
        return [budget] * stages
    return [int(b) for b in position_values([float(b) for b in budget], stages, replicas, order)]


def _per_rank(values: Sequence[float], ranks: Sequence[int], num_ranks: int) -> list[float]:
    out = [0.0] * num_ranks
    for value, rank in zip(values, ranks):
        out[rank] += value
    return out


def _variants(schedules: Sequence[str], stages: int, layers: int, virtual: Sequence[int]) -> list[tuple[str, int]]:
    """(schedule, stages per rank) pairs that exist for ``stages`` ranks and ``layers`` layers."""
    out: list[tuple[str, int]] = []
    for schedule in schedules:
        if stages == 1 and schedule != DEFAULT_SCHEDULE:
            continue  # one stage: every schedule runs the micro-batches one after another; 1F1B holds the fewest
        if traits(schedule).even_stages and stages % 2:
            continue  # pairs process i with process stages - 1 - i
        if stages < traits(schedule).planned_from:
            continue  # Chimera on 2 processes: see ScheduleTraits.planned_from
        counts = stage_counts(schedule, list(virtual))
        out += [(schedule, v) for v in counts if stages * v <= layers]
    return out


@dataclass(frozen=True)
class _Search:
    """What the ranking tries and under which conditions (see :func:`plan`)."""

    link: Link
    memory_budget: Budget
    schedules: Sequence[str]
    balances: Sequence[str]
    checkpoints: Sequence[str]
    virtual: Sequence[int]
    rendezvous: bool
    rank_speeds: Sequence[float] | None = None
    rank_order: Sequence[int] | None = None
    copy_bandwidth: float = math.inf  # bytes per second of an offload copy to host memory and back
    offload: bool = True  # whether a stage may offload (not with data_parallel="shard")

    @property
    def given_speeds(self) -> tuple[float, ...]:
        return tuple(float(v) for v in self.rank_speeds) if self.rank_speeds is not None else ()

    @property
    def free(self) -> tuple[int, ...]:
        """Bytes free per global rank, where the budget is given per rank."""
        budget = self.memory_budget
        return tuple(int(b) for b in budget) if budget is not None and not isinstance(budget, int) else ()


@dataclass(frozen=True)
class _Setting:
    """One layout, micro-batch count and schedule (with its stages per rank), as the runtime would
    place it: what every balance and recompute mode of it shares."""

    stages: int
    replicas: int
    chunks: int
    profile: Profile
    replica_batch: int
    schedule: str
    virtual: int
    plan_schedule: Schedule  # as the strategy builds it (regrouped for NCCL where needed)
    ranks: list[int]  # the rank of each stage (Chimera's copies included)
    in_flight: list[int]  # per stage of ``ranks``
    split_in_flight: list[int]  # per split stage, over its copies
    order: tuple[int, ...]  # which rank holds which slot
    held: list[float] | None  # per stage of ``ranks``, its holder's speed
    budgets: list[int] | None  # per position
    speeds: list[float] | None  # per split stage, its slower holder's speed (Chimera's copies sit on two ranks)
    capacities: list[float] | None  # per split stage, its rank's budget
    #: the schedule's offload replays by the micro-batches kept (computed once, on first use)
    replays: dict[int | None, dict[int, OffloadReplay]] = field(default_factory=dict, compare=False)

    def replayed(self, keep: int | None) -> dict[int, OffloadReplay]:
        """:func:`~lightning_pipe.plan.activations.offload_replays` of this setting's schedule, kept."""
        if keep not in self.replays:
            self.replays[keep] = offload_replays(self.plan_schedule, keep)
        return self.replays[keep]

    @property
    def split(self) -> int:
        """The layers' stages; Chimera runs each of them twice (copies)."""
        return self.stages * self.virtual

    @property
    def copies(self) -> int:
        return len(self.ranks) // self.split

    def balance(self, mode: str, checkpoint: str) -> tuple[int, ...]:
        """Layers per split stage under balance ``mode`` and recompute mode ``checkpoint``."""
        in_flight = self.split_in_flight
        return tuple(_split(self.profile, mode, self.split, in_flight, checkpoint, self.speeds, self.capacities))


def _settings(entry: tuple[int, int, int, Profile, int], search: _Search) -> Iterator[_Setting]:
    """Every schedule (and stages per rank) that runs on ``entry``'s layout and micro-batch count."""
    stages, replicas, chunks, profile, replica_batch = entry
    for schedule, v in _variants(search.schedules, stages, len(profile.layers), search.virtual):
        try:  # as the strategy builds it: regrouped for NCCL where the schedule needs it
            plan_schedule = build(schedule, stages, chunks, v, rendezvous=search.rendezvous)
        except ValueError:
            continue  # micro-batch counts interleaving cannot round, or NCCL cannot run
        ranks = stage_ranks(schedule, stages, v)
        if len(ranks) // (stages * v) > 1 and replicas > 1:
            continue  # Chimera does not combine with data-parallel replicas
        peaks = peak_in_flight(plan_schedule)
        in_flight = [peaks.get(s, 0) for s in range(len(ranks))]
        split = stages * v  # the layers' stages; Chimera runs each of them twice (copies)
        split_in_flight = [sum(in_flight[s + c * split] for c in range(len(ranks) // split)) for s in range(split)]
        # the order the runtime's balance="time" would choose (``()``: the default layout), or the given one
        order = (
            Layout(stages, replicas).placed(search.rank_order).order
            if search.rank_order is not None
            else measured_order(
                profile,
                search.rank_speeds,
                BalanceTarget("time", schedule, "never", stages, chunks, v, replicas),
                split_in_flight,
            )
        )
        held = holder_speeds(search.rank_speeds, stages, replicas, ranks, order)  # per stage of ranks (copies too)
        budgets = position_budgets(search.memory_budget, stages, replicas, order)  # per position (of one pipeline)
        # the split weighs each stage by its slower holder (Chimera's two copies sit on two ranks)
        speeds = None if held is None else stage_values(held, list(range(len(ranks))), split)
        capacities = None if budgets is None else stage_values([float(b) for b in budgets], ranks, split)
        yield _Setting(
            stages, replicas, chunks, profile, replica_batch, schedule, v, plan_schedule, ranks, in_flight,
            split_in_flight, order, held, budgets, speeds, capacities,
        )  # fmt: skip


def _predict(
    setting: _Setting, mode: str, balance: tuple[int, ...], policies: Sequence[StagePolicy], search: _Search
) -> Candidate:
    """The candidate of ``setting`` split by ``balance`` with ``policies`` (per split stage, their
    activation policy): its simulated step, all-reduce and memory; raises :class:`DeadlockError`
    where the schedule cannot run with this backend."""
    s, link, split, copies = setting, search.link, setting.split, setting.copies
    profile, ranks, held = s.profile, s.ranks, s.held
    predictions = _stage_predictions(s, balance, policies, search.copy_bandwidth)
    modes = [p.recompute for p in policies]
    costs = [
        (f + p.copy_seconds, b + p.copy_seconds, w)
        for c in range(copies)
        for (f, b, w), p in zip(
            stage_seconds(profile, balance, modes, s.chunks, link, ranks[:split], _copy(held, c, split)),
            predictions[c * split : (c + 1) * split],
        )
    ]
    simulation = simulate(s.plan_schedule, stage_costs=costs, rendezvous=search.rendezvous)
    summed_over = 2 if copies > 1 else s.replicas  # Chimera's pair sums its gradients, replicas average theirs
    grads = _per_rank(_per_stage(profile, balance, "gradient_bytes") * copies, ranks, s.stages)
    reduce = [link.all_reduce_seconds(int(g), summed_over) for g in grads]
    updates = _per_rank(
        [u for c in range(copies) for u in stage_updates(profile, balance, _copy(held, c, split))], ranks, s.stages
    )
    tail = max(r + u for r, u in zip(reduce, updates))
    static = _per_stage(profile, balance, "static_bytes") * copies
    held = [m + p.device_bytes for m, p in zip(static, predictions)]
    memory = tuple(int(m) for m in _per_rank(held, ranks, s.stages))
    fits = s.budgets is None or all(m <= b for m, b in zip(memory, s.budgets))
    recompute: str | tuple[str, ...] = modes[0] if len(set(modes)) == 1 else tuple(modes)
    keeps = tuple(p.offload for p in policies)
    return Candidate(
        s.schedule, s.chunks, mode, balance, recompute, simulation.makespan + tail,
        simulation.bubble_fraction, memory, fits, tuple(costs), s.stages, s.replicas, s.virtual,
        profile.microbatch_size, max(reduce), s.replica_batch, search.rendezvous, link, search.given_speeds,
        s.order, search.free, keeps if any(k is not None for k in keeps) else (),
        tuple(p.device_bytes for p in predictions), tuple(p.host_bytes for p in predictions),
    )  # fmt: skip


def _stage_predictions(
    s: _Setting, balance: Sequence[int], policies: Sequence[StagePolicy], copy_bandwidth: float
) -> list[StagePrediction]:
    """Per stage of ``s.ranks`` (Chimera's copies too), what its policy holds and costs."""
    layers = stage_layers(s.profile.layers, balance)
    return [
        predict_stage(
            s.plan_schedule,
            c * s.split + i,
            layers[i],
            s.in_flight[c * s.split + i],
            policy,
            copy_bandwidth,
            s.replayed,
        )
        for c in range(s.copies)
        for i, policy in enumerate(policies)
    ]


def _chosen_policies(s: _Setting, balance: Sequence[int], search: _Search) -> list[StagePolicy] | None:
    """Per split stage, the activation policy :func:`~lightning_pipe.plan.activations.choose_policies`
    picks under the budget for ``balance``; None where every stage keeps (the ``"never"`` candidate),
    where there is no budget, or where the schedule runs copies of its stages (Chimera)."""
    if s.budgets is None or s.copies > 1:
        return None
    layers = stage_layers(s.profile.layers, balance)
    static = [int(b) for b in _per_rank(_per_stage(s.profile, balance, "static_bytes"), s.ranks, s.stages)]

    def predict(i: int, policy: StagePolicy) -> StagePrediction:
        return predict_stage(s.plan_schedule, i, layers[i], s.in_flight[i], policy, search.copy_bandwidth, s.replayed)

    kept = [predict(i, StagePolicy()) for i in range(s.split)]
    held = _per_rank([float(p.device_bytes) for p in kept], s.ranks, s.stages)
    over = {r for r, (m, a, b) in enumerate(zip(static, held, s.budgets)) if m + a > b}
    if not over:
        return None  # every rank fits keeping everything: the "never" candidate
    options = [
        [predict(i, p) for p in stage_options(s.in_flight[i], search.offload)] if s.ranks[i] in over else [kept[i]]
        for i in range(s.split)
    ]
    chosen = [p.policy for p in choose_policies(options, s.ranks, static, s.budgets)]
    return None if all(p == StagePolicy() for p in chosen) else chosen


def _rank(entries: Iterable[tuple[int, int, int, Profile, int]], search: _Search) -> list[Candidate]:
    """Every distinct candidate of the ``(stages, replicas, chunks, profile, replica batch)`` entries,
    ranked; ``rank_speeds``: per global rank, relative to the rank that measured the profiles; they
    also place the ranks (:func:`~lightning_pipe.partition.solvers.rank_order.measured_order`, for the time
    split) unless ``rank_order`` fixes which rank holds which slot. ``memory_budget``: bytes for
    every rank, or per global rank (then each position's is its smallest rank's, and the memory
    split gives a smaller device less)."""
    found: dict[tuple, Candidate] = {}
    for entry in entries:
        for s in _settings(entry, search):
            for checkpoint in search.checkpoints:
                if s.chunks == 1 and checkpoint == "except_last":
                    continue  # the same as "never" with one micro-batch
                for mode in search.balances:
                    balance = s.balance(mode, checkpoint)
                    policies = [StagePolicy(checkpoint)] * s.split
                    if checkpoint == "never":  # the policy per stage the budget asks for, on this split
                        policies = _chosen_policies(s, balance, search) or policies
                    key = (s.stages, s.replicas, s.schedule, s.virtual, s.chunks, balance, tuple(policies), s.order)
                    if key in found:
                        continue
                    try:
                        found[key] = _predict(s, mode, balance, policies, search)
                    except DeadlockError:
                        break  # the schedule cannot run with this backend and micro-batch count
    return sorted(found.values(), key=lambda c: (not c.fits, c.step_seconds if c.fits else max(c.stage_bytes)))


def plan(  # noqa: PLR0913  the planner's keywords, as plan='auto', the CLI and the tests name them
    profiles: Mapping[int, Profile],
    num_stages: int,
    link: Link,
    memory_budget: Budget = None,
    schedules: Sequence[str] = PLAN_SCHEDULES,
    balances: Sequence[str] = PLAN_BALANCES,
    checkpoints: Sequence[str] = PLAN_CHECKPOINTS,
    replicas: int = 1,
    virtual: Sequence[int] = PLAN_VIRTUAL,
    replica_batch: int = 0,
    rendezvous: bool = True,
    rank_speeds: Sequence[float] | None = None,
    rank_order: Sequence[int] | None = None,
    copy_bandwidth: float = math.inf,
    offload: bool = True,
) -> list[Candidate]:
    """One layout (``num_stages`` x ``replicas``) with a profile per candidate micro-batch count
    (``profiles[chunks]``): every distinct candidate, best first: those within ``memory_budget``
    (bytes per device, or a list of them per global rank; None: no limit) by predicted step time,
    then the others by their largest rank.
    ``rendezvous``: NCCL's point-to-point model (True) or gloo's (False); a schedule that would
    hang under it (see :func:`lightning_pipe.schedules.simulate`) is left out, as the runtime refuses it.
    ``rank_speeds``: per global rank, relative to the rank that measured the profiles (None: all
    equal): each stage's compute is its profile's seconds / its rank's speed, and ``balance="time"``
    gives a slower rank less; the speeds also choose which rank holds which stage, unless ``rank_order``
    gives it (see :func:`~lightning_pipe.partition.solvers.rank_order.measured_order`).
    Under a budget, a rank whose stages would exceed it with every activation kept gets, per stage,
    the cheapest mix of offload and recompute that fits (:mod:`lightning_pipe.plan.activations`; the
    copies at ``copy_bandwidth`` bytes per second, infinite: free; ``offload=False``: recompute only)."""
    entries = [(num_stages, replicas, chunks, profile, replica_batch) for chunks, profile in sorted(profiles.items())]
    search = _Search(
        link, memory_budget, schedules, balances, checkpoints, virtual, rendezvous, rank_speeds, rank_order,
        copy_bandwidth, offload,
    )  # fmt: skip
    return _rank(entries, search)


def layouts(world_size: int, batch_size: int) -> list[tuple[int, int]]:
    """(stages, replicas) of ``world_size`` processes whose replicas split ``batch_size`` evenly."""
    divisors = [s for s in range(1, world_size + 1) if world_size % s == 0]
    return [(s, world_size // s) for s in divisors if batch_size % (world_size // s) == 0]


def microbatch_size(batch_size: int, replicas: int, chunks: int) -> int:
    """Samples in the first (largest) micro-batch of a replica's ``batch_size / replicas``."""
    per_replica = batch_size // replicas
    return -(-per_replica // chunks)


def needed_sizes(world_size: int, batch_size: int, limit: int = 32) -> list[int]:
    """The micro-batch sizes :func:`plan_layouts` looks up, largest first."""
    sizes = {
        microbatch_size(batch_size, r, m)
        for _, r in layouts(world_size, batch_size)
        for m in chunk_candidates(batch_size // r, limit)
    }
    return sorted(sizes, reverse=True)


def plan_layouts(  # noqa: PLR0913  the planner's keywords, as plan='auto', the CLI and the tests name them
    profiles: Mapping[int, Profile],
    world_size: int,
    batch_size: int,
    link: Link,
    memory_budget: Budget = None,
    schedules: Sequence[str] = PLAN_SCHEDULES,
    balances: Sequence[str] = PLAN_BALANCES,
    checkpoints: Sequence[str] = PLAN_CHECKPOINTS,
    virtual: Sequence[int] = PLAN_VIRTUAL,
    limit: int = 32,
    rendezvous: bool = True,
    rank_speeds: Sequence[float] | None = None,
    rank_order: Sequence[int] | None = None,
    copy_bandwidth: float = math.inf,
    offload: bool = True,
) -> list[Candidate]:
    """Stages x replicas too: every layout of ``world_size`` processes for a global batch of
    ``batch_size`` samples, with a profile per micro-batch size (``profiles[size]``, see
    :func:`needed_sizes`; a size without a profile leaves its candidates out), ranked as :func:`plan`."""
    entries = []
    for stages, replicas in layouts(world_size, batch_size):
        for chunks in chunk_candidates(batch_size // replicas, limit):
            size = microbatch_size(batch_size, replicas, chunks)
            if size in profiles:
                entries.append((stages, replicas, chunks, profiles[size], batch_size // replicas))
    search = _Search(
        link, memory_budget, schedules, balances, checkpoints, virtual, rendezvous, rank_speeds, rank_order,
        copy_bandwidth, offload,
    )  # fmt: skip
    return _rank(entries, search)


def _schedule_label(c: Candidate) -> str:
    return f"{c.schedule} v{c.virtual_stages}" if traits(c.schedule).interleaved else c.schedule


def activations_label(c: Candidate) -> str:
    """The recompute mode for every stage, or each stage's policy (``keep``, ``recompute``, ``offload k=0``)."""
    if isinstance(c.recompute, str) and not c.offload:
        return c.recompute
    return ", ".join(p.label() for p in c.policies)


def activations_line(c: Candidate) -> str:
    """Per stage, its activation policy and the predicted peak of its saved activations (on the
    device, and in host memory where it offloads)."""
    parts = []
    for stage, (policy, device, host) in enumerate(zip(c.policies, c.activation_bytes, c.host_bytes)):
        where = f", {host / 2**20:.2f} in host memory" if host else ""
        parts.append(f"stage {stage} {policy.label()} {device / 2**20:.2f}{where}")
    return "activations per stage (predicted peak MiB of saved tensors): " + "; ".join(parts)


def format_plans(candidates: Sequence[Candidate], top: int = 5) -> str:
    """The best ``top`` candidates as a table: layout, predicted step time, all-reduce, bubble, peak
    memory per rank (each rank's stages together). Columns are as wide as their longest entry, so
    they stay aligned whatever the schedule's name or the balance."""
    header = (
        "#",
        "schedule",
        "chunks",
        "balance",
        "recompute",
        "SxR",
        "step ms",
        "reduce ms",
        "bubble",
        "peak MiB per rank",
    )
    right = {0, 2, 5, 6, 7, 8}  # numbers are right-aligned
    rows = [
        (
            str(i + 1),
            _schedule_label(c),
            str(c.chunks),
            f"{c.balance_mode} {list(c.balance)}",
            activations_label(c),
            f"{c.depth}x{c.replicas}",
            f"{1e3 * c.step_seconds:.2f}",
            f"{1e3 * c.all_reduce_seconds:.2f}",
            f"{100 * c.bubble:.1f}%",
            ", ".join(f"{b / 2**20:.1f}" for b in c.stage_bytes) + ("" if c.fits else "  (over budget)"),
        )
        for i, c in enumerate(candidates[:top])
    ]
    widths = [max(len(row[j]) for row in (header, *rows)) for j in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if j in right else c.ljust(w) for j, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join(line(row) for row in (header, *rows))


def chunk_candidates(batch_size: int, limit: int = 32) -> list[int]:
    """Micro-batch counts worth trying: powers of two up to the batch size (and ``limit``)."""
    counts, m = [], 1
    while m <= min(batch_size, limit):
        counts.append(m)
        m *= 2
    return counts
