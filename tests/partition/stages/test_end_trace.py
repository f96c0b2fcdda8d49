"""What only the first or only the last stage of a model of its own needs, found in one traced step, or named."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pipe.partition.stages.end_trace import end_candidates, trace_ends
from lightning_pipe.partition.stages.ends import model_ends
from tests.models import CharGPT, char_loader


def _batch() -> Any:
    return next(iter(char_loader(batch_size=2)))


def _traced(model: CharGPT, forward: Any = None) -> Any:
    if forward is not None:
        model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]
    ids, targets = _batch()
    with torch.no_grad():
        return trace_ends(model, model.blocks, lambda: model.training_step((ids, targets), 0))


@pytest.mark.parametrize("options", [{}, {"sequential": True}, {"tied": True}], ids=["list", "sequential", "tied"])
def test_the_embeddings_go_to_the_first_stage_and_the_norm_and_head_to_the_last(options: dict) -> None:
    """A loop over a ModuleList or a call of an nn.Sequential; a head tied to the token embedding is a module of
    the last stage (the weight then tied across the end stages)."""
    traced = _traced(CharGPT(**options))
    assert traced.first == ("tok_emb", "pos_emb") and traced.last == ("ln_f", "head") and traced.kept == ()


def test_an_embedding_whose_result_is_read_after_the_blocks_stays_everywhere() -> None:
    """A skip from the token embedding to the head: the other stages' stand-in would give zeros there."""

    def forward(self: CharGPT, ids: torch.Tensor) -> torch.Tensor:
        embedded = self.tok_emb(ids)
        x = embedded + self.pos_emb(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x) + embedded)

    traced = _traced(CharGPT(), forward)
    assert traced.first == ("pos_emb",) and traced.last == ("ln_f", "head")
    assert traced.kept == (("tok_emb", "its result is read past the first layer's input"),)


def test_a_weight_read_directly_before_and_after_the_blocks_stays_everywhere() -> None:
    """The head as the token embedding's weight read by the forward's own code, and a module never called."""

    def forward(self: CharGPT, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok_emb.weight.T

    traced = _traced(CharGPT(), forward)
    assert traced.first == ("pos_emb",) and traced.last == ("ln_f",)
    assert dict(traced.kept) == {
        "tok_emb": "used both before and after the split layers",
        "head": "not used in the traced step",
    }


def test_a_module_used_while_the_blocks_run_stays_everywhere() -> None:
    def forward(self: CharGPT, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(ids)
        for block in self.blocks:
            x = block(x) + self.pos_emb(torch.arange(ids.shape[1]))
        return self.head(self.ln_f(x))

    traced = _traced(CharGPT(), forward)
    assert traced.first == ("tok_emb",) and dict(traced.kept) == {"pos_emb": "used while the split layers run"}


def test_a_step_that_fails_finds_nothing() -> None:
    def forward(self: CharGPT, ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("needs the Trainer")

    traced = _traced(CharGPT(), forward)
    assert traced.first == traced.last == () and "RuntimeError: needs the Trainer" in str(traced.failed)


def test_candidates_are_the_modules_beside_the_blocks_on_their_path() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = CharGPT()
            self.extra = nn.Linear(2, 2)

    outer = Outer()
    paths = [p for p, _ in end_candidates(outer, outer.gpt.blocks)]
    assert paths == ["extra", "gpt.tok_emb", "gpt.pos_emb", "gpt.ln_f", "gpt.head"]


def test_ends_named_by_hand_replace_the_trace_and_are_checked() -> None:
    model = CharGPT(tied=True)
    ends = model_ends(model, model.blocks, ("tok_emb",), ("head",))
    assert [p for p, _ in ends.pre] == ["tok_emb"] and [p for p, _ in ends.post] == ["head"]
    with pytest.raises(ValueError, match=r"'blocks.0' holds the split layers .* 'tok_emb', 'pos_emb', 'ln_f', 'head'"):
        model_ends(model, model.blocks, ("blocks.0",), None)
    with pytest.raises(ValueError, match="'nothing' is no submodule of CharGPT"):
        model_ends(model, model.blocks, None, ("nothing",))
    with pytest.raises(ValueError, match="names 'tok_emb', whose weight a module outside"):
        model_ends(model, model.blocks, ("tok_emb",), ())  # the tied head stays on every stage
