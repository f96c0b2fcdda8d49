"""The split Sequential as the module's own code sees it on one rank, without processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.partition.stages.virtual import split_stages
from lightning_pipe.runtime.around.held_layers import HeldLayer, HeldLayerError
from lightning_pipe.runtime.stage import StageModule


def _last_stage() -> tuple[nn.Sequential, StageModule]:
    layers = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Tanh(), nn.Linear(4, 4)), nn.Linear(4, 5), nn.Linear(5, 2))
    host, _ = split_stages(layers, [2, 2], [0, 1], 1, "layers")
    assert isinstance(host, StageModule)
    return layers, host


def test_positions_slices_and_iteration_are_the_unsplit_sequentials() -> None:
    layers, host = _last_stage()
    assert len(host) == 4 and host[2] is layers[2] and host[-1] is layers[3]
    assert [type(layer).__name__ for layer in host] == ["HeldLayer", "HeldLayer", "Linear", "Linear"]
    assert [i for i, _ in enumerate(host)] == [0, 1, 2, 3]
    assert list(host[1:]._modules) == ["1", "2", "3"] and host[2:][1] is layers[3]
    with pytest.raises(IndexError, match="index 4 is out of range for the pipelined Sequential of 4"):
        host[4]
    assert [n for n, _ in host.named_parameters()] == ["2.weight", "2.bias", "3.weight", "3.bias"]  # names unchanged
    assert list(host.state_dict()) == ["2.weight", "2.bias", "3.weight", "3.bias"]


def test_another_stages_layer_shows_its_structure_and_no_tensors() -> None:
    _, host = _last_stage()
    first, second = host[0], host[1]
    assert isinstance(first, HeldLayer) and (first.in_features, first.out_features) == (3, 4)
    assert list(first.parameters()) == [] and list(second.parameters()) == []
    inner = dict(second.named_children())["1"]
    assert isinstance(inner, HeldLayer) and inner.out_features == 4  # its submodules, as stand-ins
    with pytest.raises(HeldLayerError, match=r"layers\.0 \(Linear, layer 0 of the pipelined Sequential\) is held by "
                       r"pipeline stage 0 of 2: its 'weight' is not on this rank"):  # fmt: skip
        _ = first.weight
    with pytest.raises(HeldLayerError, match=r"layers\.1\.1 \(Linear, .*stage 0 of 2: its 'bias'"):
        _ = inner.bias
    with pytest.raises(HeldLayerError, match="it runs inside the Trainer's steps"):
        first(torch.randn(2, 3))
    with pytest.raises(AttributeError):
        _ = first.no_such_attribute
    with pytest.raises(HeldLayerError, match="a hook registered here would never run"):
        first.register_forward_hook(lambda *_: None)  # after the split (a callback): it would never fire


def test_a_loop_in_the_step_runs_the_stage_at_its_first_layer() -> None:
    """The last stage: the layers before its own hand the input on, its first runs the stage (the hook)."""
    _, host = _last_stage()
    seen: list[torch.Tensor] = []

    def run(value: torch.Tensor) -> torch.Tensor:
        seen.append(value)
        return torch.ones(2, 2)

    with host.routed(run):
        x = torch.randn(2, 3)
        for layer in host:
            x = layer(x)
    assert len(seen) == 1 and torch.equal(x, torch.ones(2, 2))
    with host.routed(run), pytest.raises(RuntimeError, match="called layer 2 of the pipelined Sequential after"):
        host[2](torch.randn(2, 4))
