"""Executor helpers that need no processes."""

from lightning_pipe.runtime.executor import next_receives
from lightning_pipe.schedules import Action, ActionKind


def test_each_activation_receive_knows_the_next_one_of_its_stage() -> None:
    recv = lambda stage, mb: Action(ActionKind.RECV_ACTIVATION, stage, mb)  # noqa: E731
    actions = [recv(1, 0), Action(ActionKind.FORWARD, 1, 0), recv(3, 0), recv(1, 1), recv(3, 1), recv(1, 2)]
    assert next_receives(actions) == {recv(1, 0): recv(1, 1), recv(1, 1): recv(1, 2), recv(3, 0): recv(3, 1)}


def test_gradient_receives_chain_apart_from_activation_receives() -> None:
    act = lambda mb: Action(ActionKind.RECV_ACTIVATION, 1, mb)  # noqa: E731
    grad = lambda mb: Action(ActionKind.RECV_GRADIENT, 1, mb)  # noqa: E731
    actions = [act(0), act(1), grad(0), act(2), Action(ActionKind.BACKWARD, 1, 0), grad(1), grad(2)]
    assert next_receives(actions, gradients=True) == {
        act(0): act(1),
        act(1): act(2),
        grad(0): grad(1),
        grad(1): grad(2),
    }
    assert next_receives(actions) == {act(0): act(1), act(1): act(2)}  # gradients are not posted early by default
