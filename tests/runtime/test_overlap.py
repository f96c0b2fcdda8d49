"""DualPipeV's overlapped units (F&B) in the executor: run through the model's own
``overlapped_forward_backward`` where it defines one (here in either order), with plain gradients;
a hook that skips or repeats a half is refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lightning_pipe.runtime.overlap import one_after_another, overlap_hook
from lightning_pipe.runtime.topology import Topology
from lightning_pipe.schedules import build
from lightning_pipe.schedules.actions import overlap_spans
from tests.runtime.test_pipeline import Net, _batch, _pipeline, _plain_grads, _train


class _Recorded(Net):
    """A model whose hook runs the backward half first and counts the units it ran."""

    def __init__(self, backward_first: bool, calls: int = 1) -> None:
        super().__init__()
        self.units = 0
        self.backward_first = backward_first
        self.calls = calls

    def overlapped_forward_backward(self, forward: Callable[[], None], backward: Callable[[], None]) -> None:
        self.units += 1
        for _ in range(self.calls):
            (backward if self.backward_first else forward)()
        (forward if self.backward_first else backward)()


@pytest.mark.parametrize("backward_first", [False, True])
def test_the_models_hook_runs_every_unit_and_gradients_are_plain(world_of_one: Topology, backward_first: bool) -> None:
    model = _Recorded(backward_first)
    expected = _plain_grads(model, _batch())
    pipeline = _pipeline(world_of_one, model, "dualpipev", chunks=3)
    try:
        assert pipeline.executor.overlap == model.overlapped_forward_backward
        assert _train(pipeline, model, _batch()) is True
        pipeline.hand_over_gradients()
        schedule = build("dualpipev", 1, 3, 2)
        assert model.units == len(overlap_spans(schedule.actions[0], schedule.overlapped[0])) == 3
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected[name], msg=name)
    finally:
        pipeline.close()


def test_a_hook_that_repeats_a_half_is_refused(world_of_one: Topology) -> None:
    model = _Recorded(backward_first=False, calls=2)
    pipeline = _pipeline(world_of_one, model, "dualpipev", chunks=3)
    try:
        with pytest.raises(
            RuntimeError, match=r"called forward\(\) a second time; call forward\(\) and backward\(\) once"
        ):
            _train(pipeline, model, _batch())
    finally:
        pipeline.close()
    model = _Recorded(backward_first=False, calls=0)  # the forward skipped
    pipeline = _pipeline(world_of_one, model, "dualpipev", chunks=3)
    try:
        with pytest.raises(RuntimeError, match=r"returned without calling forward\(\)"):
            _train(pipeline, model, _batch())
    finally:
        pipeline.close()


def test_without_a_hook_the_halves_run_one_after_another() -> None:
    assert overlap_hook(Net()) is one_after_another
    with pytest.raises(TypeError, match="define it as a method"):
        overlap_hook(type("Odd", (), {"overlapped_forward_backward": 3})())


def test_a_regrouped_unit_with_a_receive_between_its_computes_runs_one_compute_at_a_time() -> None:
    schedule = build("dualpipev", 2, 4, 2)
    for rank in range(2):
        spans = overlap_spans(schedule.actions[rank], schedule.overlapped[rank])
        assert len(spans) == len(schedule.overlapped[rank]) > 0  # as placed: every unit runs as one
    regrouped = build("dualpipev", 2, 4, 2, rendezvous=True)  # NCCL: receives right before their computes
    for rank in range(2):
        actions = regrouped.actions[rank]
        for start, end in overlap_spans(actions, regrouped.overlapped[rank]).items():
            assert not any(a.kind.is_recv for a in actions[start:end])


def test_a_units_forward_output_leaves_before_its_backward_computes(world_of_one: Topology) -> None:
    """Off a GPU the halves run one after the other: a send placed between them is posted between
    them, so the next stage gets the forward's output without waiting for the backward too."""
    from lightning_pipe.schedules.actions import Action, ActionKind

    model = Net()
    pipeline = _pipeline(world_of_one, model, "dualpipev", chunks=3)
    executor, events = pipeline.executor, []
    compute, post = executor._compute, executor._post
    executor._compute = lambda action, run: (events.append(action), compute(action, run))[1]  # type: ignore[method-assign]
    executor._post = lambda group, run: (events.extend(group), post(group, run))[1]  # type: ignore[method-assign]
    try:
        assert _train(pipeline, model, _batch()) is True
    finally:
        pipeline.close()
    schedule = build("dualpipev", 1, 3, 2)
    checked = 0
    for forward, backward, *_ in schedule.overlapped[0]:
        send = Action(ActionKind.SEND_ACTIVATION, forward.stage, forward.microbatch)
        if send in events:
            assert events.index(forward) < events.index(send) < events.index(backward), (forward, backward)
            checked += 1
    assert checked > 0
