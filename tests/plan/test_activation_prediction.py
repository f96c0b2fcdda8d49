"""The planner's predicted peak of saved activations per stage against the saved-tensor meter, stage by stage
in one process: each stage of the planner's choice run in its own order of the schedule."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from lightning_pipe.partition.measure.profile import measure_layers
from lightning_pipe.partition.solvers.balance import stage_bounds
from lightning_pipe.partition.solvers.costs import Profile
from lightning_pipe.plan.planner import Link, plan
from lightning_pipe.runtime.activations.meter import SavedActivationMeter
from lightning_pipe.runtime.crossing.seam import Packing
from lightning_pipe.runtime.stage import StageModule, StageRunner
from lightning_pipe.schedules import ActionKind, build

WIDTH, MICRO, CHUNKS, STAGES = 64, 16, 8, 4
#: the meter also counts what the profile's per-layer runs cannot see (none on these layers): within 2%
TOLERANCE = 0.02


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(8)])


def _measured(layers: nn.Sequential, balance: list[int], policies: list[tuple[str, int | None]]) -> list[int]:
    """Per stage, the meter's peak running the stage's forwards and backwards in 1F1B's order."""
    schedule = build("1f1b", STAGES, CHUNKS)
    peaks = []
    for stage, ((a, b), (recompute, keep)) in enumerate(zip(stage_bounds(balance), policies)):
        # every stage as a middle one (its input requires a gradient, no loss): what the profile measured
        module = StageModule(OrderedDict((str(i), layers[i]) for i in range(a, b)), stage=1, num_stages=3)
        runner = StageRunner(module, recompute=recompute, offload=keep)
        runner.meter = SavedActivationMeter(module.parameters())
        torch.manual_seed(stage)
        for action in schedule.compute(stage):
            i = action.microbatch
            if action.kind is ActionKind.FORWARD:
                runner.forward(i, CHUNKS, ([torch.randn(MICRO, WIDTH)], (True,), Packing()))
            else:
                runner.backward(i, [torch.randn(MICRO, WIDTH)])
        peaks.append(runner.meter.peak)
    return peaks


def test_the_predicted_peak_per_stage_is_what_the_meter_measures() -> None:
    layers = _layers()
    value = torch.randn(MICRO, WIDTH, requires_grad=True)
    profile = Profile(tuple(measure_layers(layers, value, torch.device("cpu"))), MICRO, "cpu", 1)
    grid = {"schedules": ("1f1b",), "balances": ("uniform",), "checkpoints": ("never",), "copy_bandwidth": 1e12}
    kept = plan({CHUNKS: profile}, STAGES, Link(0.0, float("inf")), **grid)[0]  # type: ignore[arg-type]
    one = [kept.activation_bytes[s] // (STAGES - s) for s in range(STAGES)]  # 1F1B: stage s holds 4 - s
    static = [m - a for m, a in zip(kept.stage_bytes, kept.activation_bytes)]
    # room for two and a half micro-batches: stages 0 and 1 keep one and bring one back (k=1), 2 and 3 keep all
    budget = [s + int(2.5 * a) for s, a in zip(static, one)]
    best = plan({CHUNKS: profile}, STAGES, Link(0.0, float("inf")), budget, **grid)[0]  # type: ignore[arg-type]
    assert best.fits and best.offload == (1, 1, None, None)
    for chosen in (kept, best):
        policies = [(p.recompute, p.offload) for p in chosen.policies]
        measured = _measured(layers, list(chosen.balance), policies)
        for stage, (predicted, got) in enumerate(zip(chosen.activation_bytes, measured)):
            assert abs(got - predicted) <= TOLERANCE * predicted, (stage, predicted, got, chosen.offload)
    assert best.activation_bytes == (2 * one[0], 2 * one[1], 2 * one[2], one[3])
