"""An optimizer made over the whole model before ``fabric.setup`` keeps only the parameters this rank holds
after the split: by identity, by name where the split made new tensors, its groups kept (empty ones too)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.fabric.optimizers import keep_held_parameters, names_by_identity


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2))


def test_the_groups_keep_the_held_parameters_found_by_identity_or_by_name() -> None:
    model = _model()
    names = names_by_identity(model)
    optimizer = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[2].parameters(), "lr": 0.2}], lr=0.1
    )
    model[0] = nn.Identity()  # held by another stage: released here
    model[2].weight = nn.Parameter(torch.zeros(2, 3))  # made anew (a meta-built stage, materialised)
    keep_held_parameters(optimizer, model, names)
    first, second = optimizer.param_groups
    assert first["params"] == [] and first["lr"] == 0.1  # the group stays, so group indices keep their meaning
    assert [id(p) for p in second["params"]] == [id(model[2].weight), id(model[2].bias)]


def test_an_optimizer_that_stepped_before_the_split_is_refused() -> None:
    model = _model()
    names = names_by_identity(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    model[0] = nn.Identity()
    with pytest.raises(ValueError, match="Make the optimizer before its first step"):
        keep_held_parameters(optimizer, model, names)
