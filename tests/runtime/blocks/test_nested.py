"""``nn.TransformerEncoder``'s nested hidden state between stages: padded to the shape the encoder built it
from (the transport needs shapes that follow from the batch's shapes, not from its lengths), nested again as the
receiving stage's own input is."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.runtime.blocks.nested import lengths, nested_like, padded_for_crossing
from lightning_pipe.torch_internals import nested_from_mask, nested_from_mask_shapes


def _nested(padded: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    valid = torch.arange(padded.shape[1]).unsqueeze(0) < torch.tensor(sizes).unsqueeze(1)
    return nested_from_mask(padded, valid)


def test_a_nested_hidden_state_crosses_padded_to_its_inputs_shape_and_is_nested_again() -> None:
    padded = torch.randn(3, 6, 4)
    nested = _nested(padded, [4, 2, 3])  # the longest sample is shorter than the padded input
    sent = padded_for_crossing(nested, [(2, 6, 4), (3, 6, 4), (3, 9, 5)])
    assert sent.shape == (3, 6, 4)  # the input's shape, not the longest sample's
    assert torch.equal(sent[0, :4], padded[0, :4]) and torch.equal(sent[0, 4:], torch.zeros(2, 4))
    again = nested_like(sent, _nested(torch.zeros(3, 6, 4), [4, 2, 3]))
    assert again.is_nested and lengths(again) == [4, 2, 3]
    for row, expected in zip(again.unbind(), nested.unbind()):
        assert torch.equal(row, expected)


def test_a_nested_hidden_state_built_otherwise_is_refused() -> None:
    nested = _nested(torch.randn(2, 5, 4), [5, 3])
    with pytest.raises(TypeError, match="nested tensor that was not built from a padding mask"):
        padded_for_crossing(nested, [(2, 4, 4), (3, 5, 4)])  # too short; another batch


def test_the_shapes_torch_nests_from_are_noted_while_open_and_torch_is_restored() -> None:
    original = torch._nested_tensor_from_mask
    seen: list[tuple[int, ...]] = []
    padded = torch.randn(2, 5, 4)
    valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    with nested_from_mask_shapes(seen):
        torch._nested_tensor_from_mask(padded, valid, mask_check=False)
        nested_from_mask(padded, valid)  # the pipeline's own call is not noted
    torch._nested_tensor_from_mask(padded, valid)
    assert seen == [(2, 5, 4)] and torch._nested_tensor_from_mask is original
