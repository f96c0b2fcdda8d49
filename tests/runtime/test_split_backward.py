"""B and W of a split backward on one stage, against one autograd backward."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from lightning_pipe.runtime.stage import StageModule, StageRunner


def _stage(checkpoint: str) -> tuple[StageRunner, nn.Sequential]:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Tanh(), nn.Identity(), nn.Linear(5, 3))
    stage = StageModule(OrderedDict((str(i), layer) for i, layer in enumerate(layers)), stage=1, num_stages=3)
    runner = StageRunner(stage, checkpoint=checkpoint)
    runner.split_backward = True
    return runner, layers


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_b_gives_the_input_gradient_only_and_w_the_weight_gradients(checkpoint: str) -> None:
    runner, layers = _stage(checkpoint)
    x, g = torch.randn(6, 4), torch.randn(6, 3)
    reference = x.clone().requires_grad_(True)
    layers(reference).backward(g)
    expected = {n: p.grad.clone() for n, p in layers.named_parameters()}
    layers.zero_grad(set_to_none=True)

    with torch.enable_grad():
        runner.forward(0, 1, ([x.clone()], (True,), False))
    assert bool(runner._cuts) == (checkpoint == "never")  # the graph is cut per layer where it is kept
    (input_grad,) = runner.backward_input(0, [g])
    torch.testing.assert_close(input_grad, reference.grad)
    assert all(p.grad is None for p in layers.parameters())  # B computed no weight gradient
    runner.backward_weight(0)
    for name, param in layers.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], msg=name)
    assert not runner._weights_due
