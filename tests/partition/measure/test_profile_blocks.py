"""Profiling a block container (``balance="time"/"memory"`` with ``module="model.model.layers"``):
each block measured on the arguments the model's forward gave it, the ends counted on the end blocks."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from lightning_pipe.partition.measure.profile import Timing, _with_ends, block_calls, profile_module
from lightning_pipe.partition.solvers.costs import LayerCost
from lightning_pipe.trainer.dataloaders.loaders import configured_optimizers
from tests.hf_models import LLAMA_TINY, DeferredLlama, HFModule, llama


def _tokens() -> torch.Tensor:
    return torch.randint(1, 96, (4, 12), generator=torch.Generator().manual_seed(0))


def test_each_block_is_recorded_as_the_models_forward_calls_it() -> None:
    module = HFModule(lambda: llama(False))
    ids = _tokens()
    container = module.model.model.layers
    recorder = block_calls(module, "model.model.layers", container, (ids, ids), torch.device("cpu"))
    assert module.model.model.layers is container  # put back
    assert len(recorder.calls) == 4
    # the hidden states the unsplit model's blocks see
    seen: list[torch.Tensor] = []
    hooks = [b.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach())) for b in container]
    with torch.no_grad():
        module(ids, ids)
    for h in hooks:
        h.remove()
    for call, expected in zip(recorder.calls, seen):
        torch.testing.assert_close(call.hidden, expected)
        assert "position_embeddings" in call.keywords and "attention_mask" in call.keywords
    assert recorder.pre_forward > 0 and recorder.first_input.requires_grad  # the embedding's output


def test_a_meta_built_model_is_recorded_and_left_on_the_meta_device() -> None:
    module = DeferredLlama({**LLAMA_TINY, "num_hidden_layers": 4})
    with torch.device("meta"):
        module.configure_model()
    container = module.model.model.layers
    ids = _tokens()
    recorder = block_calls(module, "model.model.layers", container, (ids, ids), torch.device("cpu"))
    assert len(recorder.calls) == 4 and not recorder.calls[2].hidden.is_meta
    assert all(t.is_meta for t in module.state_dict().values())  # nothing kept storage


def test_the_ends_are_counted_on_the_end_blocks() -> None:
    module = HFModule(lambda: llama(False))
    ids = _tokens()
    profile = profile_module(
        module,
        module.model.model.layers,
        lambda: (ids, ids),
        1,
        torch.device("cpu"),
        Timing(repeats=1),
        optimizers=lambda: configured_optimizers(module),
    )
    assert len(profile.layers) == 4
    block = sum(p.numel() * 4 for p in module.model.model.layers[0].parameters())
    embedding = module.model.model.embed_tokens.weight.numel() * 4
    head = module.model.lm_head.weight.numel() * 4
    assert [c.parameter_bytes for c in profile.layers] == [block + embedding, block, block, block + head]
    assert all(c.forward > 0 and c.backward > 0 and c.activation_bytes > 0 for c in profile.layers)


def test_with_ends_adds_to_the_first_and_last_block_only() -> None:
    cost = LayerCost(1.0, 2.0, 10, 10, 0, 5, 1, 1, input_backward=1.5)
    costs = _with_ends([cost, copy.copy(cost), cost], (0.5, 0.25, 100), (0.125, 1.0, 7))
    assert [c.forward for c in costs] == [1.5, 1.0, 1.125]
    assert [c.backward for c in costs] == [2.25, 2.0, 3.0]
    assert [c.input_backward for c in costs] == [1.75, 1.5, 2.5]
    assert [c.parameter_bytes for c in costs] == [110, 10, 17] and [c.gradient_bytes for c in costs] == [110, 10, 17]
