"""B and W of a split backward on one stage, against one autograd backward."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import ExitStack

import pytest
import torch
from torch import nn

from lightning_pipe.runtime.crossing.seam import Packing
from lightning_pipe.runtime.grads import deferred_conv, fused_linear
from lightning_pipe.runtime.stage import StageModule, StageRunner


class _Flatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


def _runner(layers: nn.Sequential, recompute: str) -> StageRunner:
    stage = StageModule(OrderedDict((str(i), layer) for i, layer in enumerate(layers)), stage=1, num_stages=3)
    fused_linear.install(stage)
    deferred_conv.install(stage)
    return StageRunner(stage, recompute=recompute)


def _reference(layers: nn.Sequential, xs: list[torch.Tensor], gs: list[torch.Tensor]) -> tuple[list, dict]:
    inputs = [x.clone().requires_grad_(True) for x in xs]
    for x, g in zip(inputs, gs):
        layers(x).backward(g)
    expected = {n: p.grad.clone() for n, p in layers.named_parameters()}
    layers.zero_grad(set_to_none=True)
    return [x.grad for x in inputs], expected


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("recompute", ["never", "always"])
def test_b_leaves_the_linear_weight_gradients_to_w(recompute: str, fuse: bool) -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Tanh(), nn.Identity(), nn.Linear(5, 3))
    xs, gs = [torch.randn(6, 4) for _ in range(3)], [torch.randn(6, 3) for _ in range(3)]
    input_grads, expected = _reference(layers, xs, gs)
    runner = _runner(layers, recompute)
    with fused_linear.accumulating(fuse), torch.enable_grad():
        for i, x in enumerate(xs):
            runner.forward(i, 3, ([x.clone()], (True,), Packing()))
        for i, g in enumerate(gs):
            (input_grad,) = runner.backward_input(i, [g])
            torch.testing.assert_close(input_grad, input_grads[i])
        assert all(p.grad is None for p in layers.parameters())  # B computed no weight gradient
        assert all(len(works) == 2 for works in runner._weights_due.values())  # one per Linear
        for i in (2, 0, 1):  # W in any order
            runner.backward_weight(i)
    for name, param in layers.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], msg=name)
    assert not runner._weights_due


def test_other_parameters_get_their_gradients_in_b_and_convolutions_in_w() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.GroupNorm(1, 3),
        nn.ReLU(),
        nn.Conv2d(3, 4, 3, stride=2, groups=1, bias=False),
        _Flatten(),
        nn.LayerNorm(16),
        nn.Linear(16, 2),
    )
    xs, gs = [torch.randn(5, 2, 6, 6) for _ in range(2)], [torch.randn(5, 2) for _ in range(2)]
    input_grads, expected = _reference(layers, xs, gs)
    runner = _runner(layers, "never")
    with ExitStack() as stack:
        stack.enter_context(fused_linear.accumulating())
        stack.enter_context(torch.enable_grad())
        for i, x in enumerate(xs):
            runner.forward(i, 2, ([x.clone()], (True,), Packing()))
        for i, g in enumerate(gs):
            (input_grad,) = runner.backward_input(i, [g])
            torch.testing.assert_close(input_grad, input_grads[i])
        deferred = {"0.weight", "0.bias", "3.weight", "6.weight", "6.bias"}
        for name, param in layers.named_parameters():
            assert (param.grad is None) == (name in deferred), name
        for i in range(2):
            runner.backward_weight(i)
    for name, param in layers.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], msg=name)


def test_outside_a_training_step_the_layers_compute_everything_at_once() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Conv1d(2, 2, 3), _Flatten(), nn.Linear(8, 1))
    x = torch.randn(3, 2, 6)
    _, expected = _reference(layers, [x], [torch.ones(3, 1)])
    stage = StageModule(OrderedDict((str(i), layer) for i, layer in enumerate(layers)), stage=0, num_stages=1)
    installed = fused_linear.install(stage) + deferred_conv.install(stage)
    assert len(installed) == 2
    layers(x).sum().backward()  # not accumulating: the layers' own forward, autograd's backward
    for name, param in layers.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], msg=name)
    fused_linear.uninstall(installed)
    deferred_conv.uninstall(installed)
    assert all("forward" not in layer.__dict__ for layer in layers)
