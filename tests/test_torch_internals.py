"""The accessors of torch's private names that need more than a line (``lightning_pipe/torch_internals.py``)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipe.torch_internals import meta_copy


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4))
        self.table = torch.arange(4.0)  # a plain tensor attribute
        self.kind = "tied"


def test_a_meta_copy_has_the_structure_and_no_memory_no_hooks_and_leaves_the_original_alone() -> None:
    model = _Tied()
    calls: list[int] = []
    model.head.register_forward_hook(lambda *_: calls.append(1))
    copied = meta_copy(model)
    assert type(copied) is _Tied and type(copied.head) is nn.Linear and copied.kind == "tied"
    assert copied.head.weight is copied.embed.weight and copied.head.weight.is_meta  # tied: copied once
    assert isinstance(copied.head.weight, nn.Parameter) and copied.head.weight.shape == (5, 4)
    assert copied.scale.is_meta and copied.table.is_meta and copied.head.bias is None
    assert [n for n, _ in copied.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(copied.state_dict()) == list(model.state_dict())
    copied.eval()
    assert model.training and model.head.training and not copied.head.training
    assert not copied.head._forward_hooks and model.head._forward_hooks
    model.head(torch.zeros(1, 4))
    assert calls == [1] and not model.head.weight.is_meta and not model.table.is_meta
