"""Choose the schedule, ``chunks``, ``balance`` and ``checkpoint`` mode from measurements.

Pure: it takes a profile of the layers per candidate micro-batch count (so each micro-batch size
is measured, not extrapolated) and the measured point-to-point link, and predicts for every
combination:

- the step time: the schedule simulated with each stage's forward and backward seconds per
  micro-batch, a transfer (latency + bytes / bandwidth) added to the action that produces it,
  plus the slowest stage's optimizer step;
- the bubble: the share of rank-time the simulation leaves idle;
- the peak memory of each stage: parameters, gradients, optimizer state and the activations of
  the micro-batches the schedule holds in flight there.

Candidates whose largest stage exceeds the memory budget are ranked after those that fit. Only
the synchronous schedules are candidates: the asynchronous ones train with delayed gradients,
which is the user's choice to make, not a speed setting. The framework's per-step work (the
Trainer's loop, logging, sharing the loss) is not in the prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from lightning_pipe.partition.balance import balance_by_cost, balance_uniform
from lightning_pipe.partition.costs import Profile, in_flight_microbatches
from lightning_pipe.schedules import SCHEDULES, simulate

PLAN_SCHEDULES = ("1f1b", "gpipe")
PLAN_BALANCES = ("uniform", "parameters", "time", "memory")
PLAN_CHECKPOINTS = ("never", "except_last", "always")


@dataclass(frozen=True)
class Link:
    """A point-to-point link between neighbouring stages, as measured."""

    latency: float  # seconds per transfer
    bandwidth: float  # bytes per second

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0


@dataclass(frozen=True)
class Candidate:
    """One layout and its prediction."""

    schedule: str
    chunks: int
    balance_mode: str  # the first balance mode that gave this split
    balance: tuple[int, ...]
    checkpoint: str
    step_seconds: float
    bubble: float
    stage_bytes: tuple[int, ...]
    fits: bool
    stage_costs: tuple[tuple[float, float], ...] = ()  # per stage (forward, backward) seconds per micro-batch

    def strategy_arguments(self) -> dict[str, object]:
        """The ``PipelineStrategy`` arguments that run this candidate."""
        return {"schedule": self.schedule, "chunks": self.chunks, "balance": list(self.balance), "checkpoint": self.checkpoint}


def _split(profile: Profile, mode: str, num_stages: int, in_flight: Sequence[int], checkpoint: str) -> list[int]:
    if mode == "uniform":
        return balance_uniform(len(profile.layers), num_stages)
    if mode == "parameters":
        return balance_by_cost([float(c.parameter_bytes) for c in profile.layers], num_stages)
    return profile.balance(mode, num_stages, in_flight, checkpoint)


def stage_seconds(profile: Profile, balance: Sequence[int], checkpoint: str, chunks: int, link: Link) -> list[tuple[float, float]]:
    """Each stage's (forward, backward) seconds per micro-batch, its outgoing transfer included:
    the forward sends the stage's output on, the backward sends the gradient of its input back."""
    costs: list[tuple[float, float]] = []
    start = 0
    recompute = {"never": 0.0, "always": 1.0, "except_last": (chunks - 1) / chunks}[checkpoint]
    for stage, count in enumerate(balance):
        layers = profile.layers[start : start + count]
        forward = sum(c.forward for c in layers)
        backward = sum(c.backward for c in layers) + recompute * forward
        if stage < len(balance) - 1:
            forward += link.seconds(layers[-1].output_bytes)
        if stage > 0:
            backward += link.seconds(layers[0].input_bytes)
        costs.append((forward, backward))
        start += count
    return costs


def stage_updates(profile: Profile, balance: Sequence[int]) -> list[float]:
    """Seconds of each stage's optimizer step (the stages step at once, after their last backward)."""
    updates, start = [], 0
    for count in balance:
        updates.append(sum(c.update for c in profile.layers[start : start + count]))
        start += count
    return updates


def plan(
    profiles: Mapping[int, Profile],
    num_stages: int,
    link: Link,
    memory_budget: Optional[int] = None,
    schedules: Sequence[str] = PLAN_SCHEDULES,
    balances: Sequence[str] = PLAN_BALANCES,
    checkpoints: Sequence[str] = PLAN_CHECKPOINTS,
) -> list[Candidate]:
    """Every distinct layout over the grid, best first: those within ``memory_budget`` (bytes per
    device; None: no limit) by predicted step time, then the others by their largest stage."""
    found: dict[tuple, Candidate] = {}
    for chunks, profile in sorted(profiles.items()):
        for schedule in schedules:
            in_flight = in_flight_microbatches(schedule, num_stages, chunks)
            for checkpoint in checkpoints:
                if chunks == 1 and checkpoint == "except_last":
                    continue  # the same as "never" with one micro-batch
                for mode in balances:
                    balance = tuple(_split(profile, mode, num_stages, in_flight, checkpoint))
                    key = (schedule, chunks, balance, checkpoint)
                    if key in found:
                        continue
                    costs = stage_seconds(profile, balance, checkpoint, chunks, link)
                    simulation = simulate(SCHEDULES[schedule](num_stages, chunks), stage_costs=costs)
                    update = max(stage_updates(profile, balance))
                    memory = tuple(profile.stage_bytes(balance, in_flight, checkpoint))
                    fits = memory_budget is None or max(memory) <= memory_budget
                    found[key] = Candidate(
                        schedule, chunks, mode, balance, checkpoint, simulation.makespan + update, simulation.bubble_fraction, memory, fits,
                        tuple(costs),
                    )
    return sorted(found.values(), key=lambda c: (not c.fits, c.step_seconds if c.fits else max(c.stage_bytes)))


def format_plans(candidates: Sequence[Candidate], top: int = 5) -> str:
    """The best ``top`` candidates as a table: predicted step time, bubble, peak memory per stage."""
    rows = [f"{'#':>2} {'schedule':<8} {'chunks':>6} {'balance':<22} {'checkpoint':<11} {'step ms':>8} {'bubble':>7}  peak MiB per stage"]
    for i, c in enumerate(candidates[:top]):
        balance = f"{c.balance_mode} {list(c.balance)}"
        memory = ", ".join(f"{b / 2**20:.1f}" for b in c.stage_bytes) + ("" if c.fits else "  (over budget)")
        rows.append(
            f"{i + 1:>2} {c.schedule:<8} {c.chunks:>6} {balance:<22} {c.checkpoint:<11} {1e3 * c.step_seconds:>8.2f} {100 * c.bubble:>6.1f}%  {memory}"
        )
    return "\n".join(rows)


def chunk_candidates(batch_size: int, limit: int = 32) -> list[int]:
    """Micro-batch counts worth trying: powers of two up to the batch size (and ``limit``)."""
    counts, m = [], 1
    while m <= min(batch_size, limit):
        counts.append(m)
        m *= 2
    return counts


__all__ = ["Candidate", "Link", "chunk_candidates", "format_plans", "plan", "stage_seconds", "stage_updates"]
