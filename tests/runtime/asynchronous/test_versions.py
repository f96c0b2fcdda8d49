"""PipeDream's weight stashing, copy-on-write (no processes)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipe.runtime.asynchronous.versions import WeightVersions


def test_a_version_keeps_the_values_its_forward_saw_after_the_update() -> None:
    layer = nn.Linear(3, 2)
    before = layer.weight.detach().clone()
    versions = WeightVersions(layer)
    versions.create(0)
    assert versions.params(0)["weight"].untyped_storage().data_ptr() == layer.weight.untyped_storage().data_ptr()
    assert versions.nbytes() == 0  # no copy until the parameters are about to change
    versions.protect()
    with torch.no_grad():
        layer.weight.add_(1.0)
    assert torch.equal(versions.params(0)["weight"], before)
    assert torch.equal(layer.weight, before + 1.0)
    assert versions.nbytes() > 0 and versions.peak_bytes >= versions.nbytes()


def test_a_version_gathers_the_gradient_of_the_backwards_through_it_and_is_dropped() -> None:
    layer = nn.Linear(3, 2)
    versions = WeightVersions(layer)
    versions.create(4)
    x = torch.ones(1, 3)
    weight, bias = versions.params(4)["weight"], versions.params(4)["bias"]
    (x @ weight.t() + bias).sum().backward()
    assert layer.weight.grad is None  # the gradient reached the version, not the parameter
    grads = versions.gradient(4)
    assert torch.equal(grads["weight"], torch.ones(2, 3)) and torch.equal(grads["bias"], torch.ones(2))
    assert versions.held() == []
