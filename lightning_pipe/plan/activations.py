"""The planner's activation policy per stage: keep, recompute or offload ``k``, chosen under a memory budget.

Pure: a schedule, a profile and a split in; per stage a policy with its predicted peak of saved
activation bytes, the bytes it puts in host memory and the seconds it adds, out.

What each policy holds at a stage's peak, in the saved-tensor bytes that
:class:`~lightning_pipe.runtime.activations.meter.SavedActivationMeter` counts:

- keep: ``n x A``, with ``n`` the micro-batches in flight at the stage's peak (from the schedule) and
  ``A`` one micro-batch's saved activations of the stage's layers (a tensor saved both as a layer's
  output and as the next layer's input counted once, as in the stage);
- recompute (``"always"``): ``n x I + A``, ``I`` the stage input each recomputed micro-batch keeps,
  and one micro-batch's activations rebuilt in its backward;
- offload keep ``k``: the stage's own order of forwards and backwards replayed as the runtime runs
  it (:func:`offload_replay`: a forward goes to host memory when ``k`` micro-batches' saved tensors
  are on the device already, a backward brings the offloaded micro-batch nearest to it back ahead
  of its own backward: the next one, forwards in order or, under GPipe, in reverse), ``peak x A`` on the device.

Time: recompute adds a forward of the stage to each backward; offload adds each offloaded micro-batch's
copies (out after its forward, back before its backward) at the measured copy bandwidth, spread over
the stage's micro-batches, as if not overlapped with compute (the runtime copies on their own CUDA
stream on a GPU, so this is the most they cost; on CPU processes they copy host to host, in line).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_pipe.partition.solvers.balance import stage_bounds
from lightning_pipe.partition.solvers.costs import LayerCost, saved_bytes
from lightning_pipe.schedules import ActionKind, Schedule


@dataclass(frozen=True)
class StagePolicy:
    """One stage's activation policy: its recompute mode and the micro-batches it keeps on the device
    when offloading (``offload=None``: nothing offloaded)."""

    recompute: str = "never"
    offload: int | None = None

    def label(self) -> str:
        if self.recompute != "never":
            return "recompute" if self.recompute == "always" else self.recompute
        return "keep" if self.offload is None else f"offload k={self.offload}"


KEEP = StagePolicy()


@dataclass(frozen=True)
class OffloadReplay:
    """A stage's offload over one step: micro-batches' saved tensors on the device at the peak (those
    kept from their forwards, those brought back, those waiting for their W), in host memory at the
    peak, and the forwards that went to host memory."""

    peak: int
    host_peak: int
    offloaded: int


def offload_replay(schedule: Schedule, stage: int, keep: int | None) -> OffloadReplay:
    """Replay ``stage``'s forwards and backwards as :class:`~lightning_pipe.runtime.stage.StageRunner`
    runs them with ``offload=keep`` (None: nothing offloaded)."""
    return offload_replays(schedule, keep).get(stage, OffloadReplay(0, 0, 0))


def offload_replays(schedule: Schedule, keep: int | None) -> dict[int, OffloadReplay]:
    """:func:`offload_replay` of every stage of ``schedule``, in one pass over its actions."""
    return {stage: replay.result() for stage, replay in _replayed(schedule, keep).items()}


class _Replay:
    """One stage's state in :func:`offload_replays`."""

    def __init__(self, keep: int | None, split: bool) -> None:
        self.keep, self.split = keep, split
        self.kept: set[int] = set()  # forward done on the device, backward not yet
        self.away: dict[int, bool] = {}  # offloaded, backward not yet: brought back yet?
        self.due: set[int] = set()  # B done, W not yet (split backward)
        self.peak = self.host_peak = self.offloaded = 0

    def on_device(self) -> int:
        return len(self.kept) + sum(self.away.values()) + len(self.due)

    def forward(self, mb: int) -> None:
        if self.keep is not None and len(self.kept | self.due) >= self.keep:
            self.away[mb] = False
            self.offloaded += 1
        else:
            self.kept.add(mb)

    def backward(self, mb: int) -> None:
        if mb in self.away:
            self.away[mb] = True  # brought back for its own backward, if not ahead of it
            self.peak = max(self.peak, self.on_device())
            del self.away[mb]
        else:
            self.kept.discard(mb)
        if self.split:
            self.due.add(mb)
        if self.away:  # the offloaded micro-batch nearest to it (its backward is the next) comes back ahead
            self.away[min(self.away, key=lambda other: (abs(other - mb), other))] = True

    def note(self) -> None:
        self.peak = max(self.peak, self.on_device())
        self.host_peak = max(self.host_peak, sum(not back for back in self.away.values()))

    def result(self) -> OffloadReplay:
        return OffloadReplay(self.peak, self.host_peak, self.offloaded)


def _replayed(schedule: Schedule, keep: int | None) -> dict[int, _Replay]:
    stages: dict[int, _Replay] = {}
    for rank in range(schedule.num_ranks):
        for action in schedule.compute(rank):
            replay = stages.setdefault(action.stage, _Replay(keep, schedule.split_backward))
            if action.kind is ActionKind.FORWARD:
                if schedule.forward_only:
                    continue
                replay.forward(action.microbatch)
            elif action.kind is ActionKind.BACKWARD:
                replay.backward(action.microbatch)
            elif action.kind is ActionKind.WEIGHT:
                replay.due.discard(action.microbatch)
            replay.note()
    return stages


@dataclass(frozen=True)
class StagePrediction:
    """What one stage's policy costs: saved activation bytes on the device and in host memory at their
    peaks, the seconds of one offload copy (added to each forward and each backward, on average over
    the micro-batches) and of the recomputed forward (added to each backward, on the profiling rank)."""

    policy: StagePolicy
    device_bytes: int
    host_bytes: int = 0
    copy_seconds: float = 0.0
    recompute_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return 2 * self.copy_seconds + self.recompute_seconds


def predict_stage(
    schedule: Schedule,
    stage: int,
    layers: Sequence[LayerCost],
    in_flight: int,
    policy: StagePolicy,
    copy_bandwidth: float,
    replays: Callable[[int | None], dict[int, OffloadReplay]] | None = None,
) -> StagePrediction:
    """The prediction of ``policy`` on ``stage`` (its ``layers``, ``in_flight`` micro-batches at its peak);
    ``replays``: :func:`offload_replays` of the schedule by ``keep``, where the caller keeps them."""
    saved = saved_bytes(layers)
    if policy.recompute != "never":
        chunks = schedule.num_microbatches
        recomputed = 1.0 if policy.recompute == "always" else (chunks - 1) / chunks
        held = in_flight * layers[0].input_bytes + saved
        return StagePrediction(policy, held, recompute_seconds=recomputed * sum(c.forward for c in layers))
    if policy.offload is None:
        return StagePrediction(policy, in_flight * saved)
    replay = (replays or (lambda keep: offload_replays(schedule, keep)))(policy.offload)[stage]
    copy = replay.offloaded * saved / copy_bandwidth / max(schedule.num_microbatches, 1)
    return StagePrediction(policy, replay.peak * saved, replay.host_peak * saved, copy_seconds=copy)


def stage_options(in_flight: int, offload: bool = True) -> list[StagePolicy]:
    """The policies worth pricing on a stage holding ``in_flight`` micro-batches at its peak: keep,
    offload keeping ``k`` for each ``k`` below it (most kept first; none where ``offload`` is False),
    recompute."""
    if in_flight <= 0:
        return [KEEP]
    keeps = range(in_flight - 1, -1, -1) if offload else range(0)
    return [KEEP, *(StagePolicy(offload=k) for k in keeps), StagePolicy("always")]


def choose_policies(
    options: Sequence[Sequence[StagePrediction]],
    ranks: Sequence[int],
    static: Sequence[int],
    budgets: Sequence[int] | None,
) -> list[StagePrediction]:
    """Per stage (on rank ``ranks[s]``), the policy among ``options[s]`` (keep first): every stage
    keeps unless its rank's ``static`` bytes plus its stages' activations exceed its budget; then the
    rank's stages move, one step at a time, to a policy holding fewer bytes, always the step adding
    the fewest seconds per byte it saves, until the rank fits (or nothing is left to save: the
    candidate is over budget). ``budgets``: per rank; None: no limit (every stage keeps)."""
    chosen = [0] * len(options)
    frontiers = [_frontier(o) for o in options]
    if budgets is None:
        return [o[0] for o in options]
    for rank, budget in enumerate(budgets):
        mine = [s for s, r in enumerate(ranks) if r == rank]

        def total() -> int:
            return static[rank] + sum(frontiers[s][chosen[s]].device_bytes for s in mine)  # noqa: B023

        while total() > budget:
            steps = [(_price(frontiers[s][chosen[s]], frontiers[s][chosen[s] + 1]), s) for s in mine
                     if chosen[s] + 1 < len(frontiers[s])]  # fmt: skip
            if not steps:
                break
            chosen[min(steps)[1]] += 1
    return [frontiers[s][chosen[s]] for s in range(len(options))]


def _price(current: StagePrediction, step: StagePrediction) -> float:
    """Seconds added per byte saved, moving a stage from ``current`` to ``step``."""
    return (step.seconds - current.seconds) / (current.device_bytes - step.device_bytes)


def _frontier(options: Sequence[StagePrediction]) -> list[StagePrediction]:
    """From the first option (keep), the options each holding fewer bytes than the one before at more
    seconds; an option that another holding no more bytes beats on seconds is dropped."""
    out = [options[0]]
    for p in sorted(options[1:], key=lambda p: (-p.device_bytes, p.seconds)):
        if p.device_bytes >= out[-1].device_bytes:
            continue  # saves nothing over what is kept already
        while len(out) > 1 and out[-1].seconds >= p.seconds:
            out.pop()  # holds more than p and costs no less
        out.append(p)
    return out


def stage_layers(layers: Sequence[LayerCost], balance: Sequence[int]) -> list[Sequence[LayerCost]]:
    return [layers[a:b] for a, b in stage_bounds(balance)]
