"""Per-action timings: one span per compute action, in schedule order, inside the step."""

import itertools
import time
from collections.abc import Callable

import torch
from torch import nn

from lightning_pipe.partition import stage_layers
from lightning_pipe.runtime.executor import Callbacks, Executor
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.stage import StageModule, StageRunner
from lightning_pipe.runtime.timings import Timeline
from lightning_pipe.schedules import one_f_one_b


def _executor(step_sleep: float) -> tuple[Executor, Callable[[Timeline | None], Callbacks], int]:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    stage = StageModule(stage_layers(seq, [2], 0), 0, 1)
    x = torch.randn(6, 4).chunk(3)

    def step(i: int) -> torch.Tensor:
        time.sleep(step_sleep)  # a forward of known length
        return stage(x[i]).sum()

    executor = Executor(Transport([0], torch.device("cpu")), {0: StageRunner(stage)}, rank=0)
    return executor, lambda timeline: Callbacks(step, timeline=timeline), len(x)


def test_spans_follow_the_schedule_and_add_up() -> None:
    executor, calls, m = _executor(0.01)
    executor.run(one_f_one_b(1, m), [None] * m, calls(None))  # untimed: nothing recorded anywhere
    timeline = Timeline(torch.device("cpu"))
    for _ in range(2):
        executor.run(one_f_one_b(1, m), [None] * m, calls(timeline))
    assert len(timeline.steps) == 2
    compute = [(s.name, s.microbatch) for s in timeline.steps[0] if s.name in ("F", "B")]
    assert compute == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    spans = timeline.steps[1]
    step = spans[-1]
    assert step.name == "step"
    for earlier, later in itertools.pairwise(spans[:-1]):
        assert 0 <= earlier.start <= earlier.end <= later.start <= step.end
    totals = timeline.totals()
    assert totals["F"] >= m * 0.01  # the sleeps are inside the forward spans
    assert abs(totals["F"] + totals["B"] + totals["other"] - totals["step"]) < 1e-9
    assert totals["other"] >= 0


def test_bounded_history_and_listeners() -> None:
    executor, calls, m = _executor(0.0)
    timeline = Timeline(torch.device("cpu"), keep=1)
    heard: list[list[str]] = []
    timeline.listeners.append(lambda spans: heard.append([s.name for s in spans]))
    for _ in range(3):
        executor.run(one_f_one_b(1, m), [None] * m, calls(timeline))
    assert len(timeline.steps) == len(timeline.origins) == 1  # only the last step is kept
    assert len(heard) == 3 and all(names[-1] == "step" and names.count("F") == m for names in heard)
    assert [s.name for s in timeline.steps[0]] == heard[-1]
    timeline.keep = 0
    executor.run(one_f_one_b(1, m), [None] * m, calls(timeline))
    assert timeline.steps == [] and len(heard) == 4
