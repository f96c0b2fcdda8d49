"""A measured profile of the layers and the stage costs behind ``balance="time"`` and ``"memory"``.

Pure: numbers in, layer counts out. :mod:`lightning_pipe.partition.measure.profile` measures the numbers on
the device; everything here is tested without a model or processes.

Time: a stage costs the sum of its layers' forward and backward seconds per micro-batch (plus one
more forward per layer when activations are recomputed). Memory: a stage holds its layers'
parameters, gradients and optimizer state, plus the activations saved for the backward of every
micro-batch in flight on it (1F1B: ``stages - stage``, GPipe: all ``chunks``); with recomputation
only each in-flight micro-batch's stage input is kept, and one micro-batch's activations at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from lightning_pipe.partition.solvers.balance import (
    Owners,
    balance_by_cost,
    balance_by_stage_cost,
    balance_uniform,
    stage_bounds,
)
from lightning_pipe.partition.solvers.speeds import all_equal, balance_by_speed
from lightning_pipe.schedules import build, is_async, peak_in_flight, traits

MEASURED_BALANCES = ("time", "memory")


@dataclass(frozen=True)
class LayerCost:
    """What one layer of the Sequential costs for one micro-batch, as measured."""

    forward: float  # seconds
    backward: float  # seconds
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int  # optimizer state (momentum, Adam's moments)
    activation_bytes: int  # saved for the backward, per micro-batch
    input_bytes: int  # the layer's input, per micro-batch
    output_bytes: int  # what the layer passes on, per micro-batch (sent between stages at a cut)
    update: float = 0.0  # seconds of the optimizer step on the layer's parameters (once per batch)
    # a split backward (zero-bubble schedules), measured apart: B (input gradient, with the work the
    # layer does not defer) and W (the deferred weight-gradient work); None: not measured
    input_backward: float | None = None
    weight_backward: float = 0.0
    # of ``activation_bytes``, the layer's input and its output saved as they are (a Sequential's next
    # layer saving its input saves the same tensor this layer saved as its output: a stage holds it once)
    saved_input_bytes: int = 0
    saved_output_bytes: int = 0

    @property
    def split_backward(self) -> tuple[float, float]:
        """(B, W) seconds; without a split measurement the whole backward is B and W is 0."""
        if self.input_backward is None:
            return self.backward, 0.0
        return self.input_backward, self.weight_backward

    @property
    def static_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


def saved_bytes(layers: Sequence[LayerCost]) -> int:
    """One micro-batch's saved activations of a stage of ``layers``: a tensor one layer saves as its
    output and the next as its input is one tensor, held once."""
    shared = sum(min(a.saved_output_bytes, b.saved_input_bytes) for a, b in pairwise(layers))
    return sum(c.activation_bytes for c in layers) - shared


@dataclass(frozen=True)
class Profile:
    """Per-layer costs measured on one micro-batch of ``microbatch_size`` samples on ``device``."""

    layers: tuple[LayerCost, ...]
    microbatch_size: int
    device: str
    repeats: int

    def time_costs(self, checkpoint: str = "never") -> list[float]:
        """Seconds per micro-batch of each layer; recomputation adds a forward."""
        extra = 0.0 if checkpoint == "never" else 1.0
        return [(1.0 + extra) * c.forward + c.backward for c in self.layers]

    def stage_seconds(self, balance: Sequence[int], checkpoint: str = "never") -> list[float]:
        costs = self.time_costs(checkpoint)
        return [sum(costs[a:b]) for a, b in stage_bounds(balance)]

    def stage_bytes(self, balance: Sequence[int], in_flight: Sequence[int], checkpoint: str = "never") -> list[int]:
        """Peak bytes of each stage with ``in_flight[s]`` micro-batches' activations held on stage s."""
        return [self._stage_memory(s, a, b, in_flight, checkpoint) for s, (a, b) in enumerate(stage_bounds(balance))]

    def _stage_memory(self, stage: int, start: int, stop: int, in_flight: Sequence[int], checkpoint: str) -> int:
        layers = self.layers[start:stop]
        static = sum(c.static_bytes for c in layers)
        saved = saved_bytes(layers)
        if checkpoint == "never":
            return static + in_flight[stage] * saved
        return static + in_flight[stage] * layers[0].input_bytes + saved

    def balance(
        self,
        mode: str,
        num_stages: int,
        in_flight: Sequence[int],
        checkpoint: str = "never",
        owners: Owners = None,
        speeds: Sequence[float] | None = None,
        capacities: Sequence[float] | None = None,
    ) -> list[int]:
        """The contiguous split with the least slowest (``"time"``) or largest (``"memory"``) stage;
        ``owners``: which layers hold a parameter, one for every stage where they allow it. Unequal
        devices (see :mod:`lightning_pipe.partition.solvers.speeds`): ``speeds`` per stage divide its seconds,
        ``capacities`` (free bytes of the device holding it) its bytes; equal ones change nothing."""
        n = len(self.layers)
        for name, values in (("speeds", speeds), ("capacities", capacities)):
            if values is not None and len(values) != num_stages:
                raise ValueError(f"{name} has {len(values)} entries for {num_stages} stages")
        if mode == "time":
            costs = self.time_costs(checkpoint)
            if sum(costs) <= 0.0:
                return balance_uniform(n, num_stages, owners)
            if speeds is not None and not all_equal(speeds):
                return balance_by_speed(costs, speeds, owners)
            return balance_by_cost(costs, num_stages, owners)
        if mode == "memory":
            if len(in_flight) != num_stages:
                raise ValueError(f"in_flight has {len(in_flight)} entries for {num_stages} stages")
            scale = [1.0] * num_stages
            if capacities is not None and not all_equal(capacities):
                scale = [max(capacities) / c for c in capacities]
            return balance_by_stage_cost(
                n, num_stages, lambda s, a, b: scale[s] * self._stage_memory(s, a, b, in_flight, checkpoint), owners
            )
        raise ValueError(f"Unknown measured balance {mode!r}. Valid: {', '.join(MEASURED_BALANCES)}.")

    def report(self, balance: Sequence[int], in_flight: Sequence[int], checkpoint: str = "never") -> str:
        """One line: per stage, its layers, milliseconds per micro-batch and peak MiB."""
        seconds = self.stage_seconds(balance, checkpoint)
        memory = self.stage_bytes(balance, in_flight, checkpoint)
        parts = [
            f"stage {s}: {n} layers, {1e3 * t:.2f} ms, {m / 2**20:.1f} MiB"
            for s, (n, t, m) in enumerate(zip(balance, seconds, memory))
        ]
        return (
            f"profile of {len(self.layers)} layers on {self.device} (micro-batch of {self.microbatch_size}): "
            + "; ".join(parts)
        )


def in_flight_microbatches(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> list[int]:
    """Micro-batches whose activations each stage holds at once, read off the schedule's own action
    lists (GPipe: all of them; 1F1B: ``stages - stage``); the asynchronous schedules hold
    ``stages - stage`` in their steady state, across batches. With ``virtual_stages`` (interleaved
    1F1B, ZB-V) ``num_stages`` counts processes and the list has an entry per stage of the
    ``num_stages x virtual_stages``."""
    if is_async(schedule):
        return [num_stages - s for s in range(num_stages)]
    peaks = peak_in_flight(build(schedule, num_stages, num_microbatches, virtual_stages))
    held = [peaks.get(s, 0) for s in range(num_stages * virtual_stages)]
    if traits(schedule).mirrored:  # each stage runs twice: the down pipeline's and the up pipeline's copy
        held = [n + peaks.get(num_stages + s, 0) for s, n in enumerate(held)]
    return held
