"""A Hugging Face model built on the meta device is initialised by its own ``_init_weights``, layer by
layer from the run's seed, so that any split starts from the same weights and they follow HF's rules."""

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pipe import init_like_pipeline
from lightning_pipe.partition.stages.ends import extended, find_ends
from lightning_pipe.partition.stages.materialize import check_initializable, materialize

transformers = pytest.importorskip("transformers")


class Holder(L.LightningModule):
    """What a user writes: the HF model as an attribute, plus a head of their own outside it."""

    def __init__(self, build: Callable[[], nn.Module], head: bool = False) -> None:
        super().__init__()
        self.model = build()
        if head:
            self.head = nn.Linear(8, 3)


def gpt2(layers: int = 4, width: int = 32, vocab: int = 100, positions: int = 16) -> Callable[[], nn.Module]:
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=positions, bos_token_id=0, eos_token_id=0
    )
    return lambda: transformers.GPT2LMHeadModel(config)


def llama(tied: bool, layers: int = 4, width: int = 32, vocab: int = 100) -> Callable[[], nn.Module]:
    config = transformers.LlamaConfig(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
    )
    return lambda: transformers.LlamaForCausalLM(config)


BLOCKS = {"gpt2": "model.transformer.h", "llama": "model.model.layers"}


def on_meta(build: Callable[[], nn.Module], **kwargs: Any) -> Holder:
    with torch.device("meta"):
        return Holder(build, **kwargs)


def blocks(holder: nn.Module, kind: str) -> nn.ModuleList:
    """The layers the pipeline materialises one by one: the blocks (0-3), then the model's input and
    output embeddings (4 and 5; see lightning_pipe.partition.stages.ends)."""
    container = holder.get_submodule(BLOCKS[kind])
    return extended(container, find_ends(holder, container))


EVERYTHING = range(6)  # the 4 blocks and the 2 ends
ENDS = [4, 5]


def test_gpt2_follows_hfs_rules_including_the_scaled_residual_projections() -> None:
    """Hidden 256, 4 layers: every tensor's std within 5% of an eager HF build's (normal(0, 0.02),
    c_proj at 0.02/sqrt(2 * n_layer)); norms ones and biases zeros exactly; the tie kept."""
    build = gpt2(layers=4, width=256, vocab=1000, positions=128)
    meta = on_meta(build)
    materialize(meta, blocks(meta, "gpt2"), EVERYTHING, "cpu", seed=0)
    torch.manual_seed(0)
    eager = Holder(build).state_dict()
    got = meta.state_dict()
    assert list(got) == list(eager)
    for name, value in got.items():
        expected = eager[name]
        if float(expected.std()) == 0.0:  # LayerNorm weights (ones), biases (zeros)
            assert torch.equal(value, expected), name
        else:
            assert abs(float(value.std()) / float(expected.std()) - 1) < 0.05, (
                name,
                float(value.std()),
                float(expected.std()),
            )
            assert abs(float(value.mean())) < 0.1 * float(expected.std()), name
    for i in range(4):
        for proj in (f"model.transformer.h.{i}.attn.c_proj.weight", f"model.transformer.h.{i}.mlp.c_proj.weight"):
            assert abs(float(got[proj].std()) / (0.02 / math.sqrt(2 * 4)) - 1) < 0.05, proj
        assert abs(float(got[f"model.transformer.h.{i}.attn.c_attn.weight"].std()) / 0.02 - 1) < 0.05
    assert (
        float(got["model.transformer.h.0.ln_1.weight"].min())
        == 1.0
        == float(got["model.transformer.h.0.ln_1.weight"].max())
    )
    assert meta.model.lm_head.weight is meta.model.transformer.wte.weight


@pytest.mark.parametrize("tied", [True, False])
def test_llama_follows_hfs_rules(tied: bool) -> None:
    """GQA Llama, hidden 256: Linear and Embedding at normal(0, initializer_range) as an eager build,
    RMSNorm ones, the rotary frequencies (non-persistent buffers, outside the blocks) exactly HF's."""
    build = llama(tied, layers=4, width=256, vocab=1000)
    meta = on_meta(build)
    materialize(meta, blocks(meta, "llama"), EVERYTHING, "cpu", seed=0)
    torch.manual_seed(0)
    eager_model = Holder(build)
    eager = {
        k: v.detach() for k, v in [*eager_model.named_parameters(remove_duplicate=False), *eager_model.named_buffers()]
    }
    got = {k: v.detach() for k, v in [*meta.named_parameters(remove_duplicate=False), *meta.named_buffers()]}
    assert set(got) == set(eager) and "model.model.rotary_emb.inv_freq" in got
    for name, value in got.items():
        expected = eager[name]
        if "norm" in name or "rotary_emb" in name:
            assert torch.equal(value, expected), name
        else:
            assert abs(float(value.std()) / float(expected.std()) - 1) < 0.05, (
                name,
                float(value.std()),
                float(expected.std()),
            )
            assert abs(float(value.std()) / 0.02 - 1) < 0.05, name
    assert (meta.model.lm_head.weight is meta.model.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_any_subset_of_layers_gets_the_same_values(kind: str) -> None:
    """Layers 0-1 on one rank, 2-3 on another, 1-2 on a third: each tensor equal to materialising all
    at once; the other layers stay on the meta device. This is what makes 2 and 4 stages start alike."""
    build = gpt2() if kind == "gpt2" else llama(tied=True)
    whole = on_meta(build)
    materialize(whole, blocks(whole, kind), EVERYTHING, "cpu", seed=5)
    reference = whole.state_dict()
    for local in ([0, 1], [2, 3], [1, 2], [3]):
        part = on_meta(build)
        materialize(part, blocks(part, kind), local + ENDS, "cpu", seed=5)
        held = {k: v for k, v in part.state_dict().items() if not v.is_meta}
        prefix = BLOCKS[kind] + "."
        layers_held = {k.split(".")[len(prefix.split(".")) - 1] for k in held if k.startswith(prefix)}
        assert layers_held == {str(i) for i in local}
        assert set(held) | {k for k in reference if k.startswith(prefix) and k not in held} == set(reference)
        for name, value in held.items():
            torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=name)
    other = on_meta(build)
    materialize(other, blocks(other, kind), EVERYTHING, "cpu", seed=6)
    first = f"{BLOCKS[kind]}.0.mlp.{'c_fc' if kind == 'gpt2' else 'up_proj'}.weight"
    assert not torch.equal(other.state_dict()[first], reference[first])  # another seed, other values


@pytest.mark.parametrize("kind, tied", [("gpt2", True), ("llama", True), ("llama", False)])
def test_the_ends_materialised_apart_get_the_values_of_the_whole(kind: str, tied: bool) -> None:
    """The first stage holds the input embeddings (4), the last the head (5): each gets the value it
    has when everything is materialised at once, a tied head the embedding's value although that
    rank never holds the embedding."""
    build = gpt2() if kind == "gpt2" else llama(tied=tied)
    whole = on_meta(build)
    materialize(whole, blocks(whole, kind), EVERYTHING, "cpu", seed=3)
    reference = whole.state_dict()
    first, last = on_meta(build), on_meta(build)
    materialize(first, blocks(first, kind), [0, 1, 4], "cpu", seed=3)
    materialize(last, blocks(last, kind), [2, 3, 5], "cpu", seed=3)
    head = "model.lm_head.weight"
    embedding = "model.transformer.wte.weight" if kind == "gpt2" else "model.model.embed_tokens.weight"
    assert not first.state_dict()[embedding].is_meta and not last.state_dict()[head].is_meta
    assert last.state_dict()[embedding].is_meta  # left for the stand-in, tied or not
    for part in (first, last):
        for name, value in part.state_dict().items():
            if not value.is_meta:
                torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=name)
    if tied:
        torch.testing.assert_close(last.state_dict()[head], reference[embedding], rtol=0, atol=0)


def test_modules_outside_the_hf_model_keep_their_own_rule_and_a_plain_run_starts_alike() -> None:
    """The user's head beside the HF model is not HF's: reset_parameters (a non-zero bias, where HF
    zeroes biases). init_like_pipeline with the blocks' path gives a plain run the same start."""
    from lightning_pipe.partition.stages.hf_init import pretrained_owners

    meta = on_meta(gpt2(), head=True)
    owners = pretrained_owners(meta)
    assert owners[id(meta.model.lm_head)] is meta.model and id(meta.head) not in owners
    assert owners[id(meta.model.transformer.h[0].attn.c_proj)] is meta.model.transformer  # the nearest, as HF's walk
    materialize(meta, blocks(meta, "gpt2"), [0, 1], "cpu", seed=2)
    assert float(meta.head.bias.detach().abs().sum()) > 0
    assert float(meta.model.transformer.h[0].attn.c_attn.bias.detach().abs().sum()) == 0.0
    plain = init_like_pipeline(on_meta(gpt2(), head=True), seed=2, sequential="model.transformer.h")
    for name, value in meta.state_dict().items():
        if not value.is_meta:
            torch.testing.assert_close(value, plain.state_dict()[name], rtol=0, atol=0, msg=name)


def test_an_eager_hf_model_is_reinitialised_by_the_same_rule() -> None:
    """init_like_pipeline on an eagerly built HF model (whose modules HF already flagged as initialised)
    gives the values a meta-built one gets."""
    eager = init_like_pipeline(Holder(gpt2()), seed=4, sequential="model.transformer.h")
    meta = init_like_pipeline(on_meta(gpt2()), seed=4, sequential="model.transformer.h")
    for name, value in meta.state_dict().items():
        torch.testing.assert_close(eager.state_dict()[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("model", ["vit", "bert"])
def test_other_hf_models_initialise_every_tensor(model: str) -> None:
    """ViT (cls token and position embeddings by truncated normal) and BERT (position_ids and
    token_type_ids, non-persistent buffers set by _init_weights): no tensor is left unset (the NaN
    check would name it) and the buffers equal an eager build's."""
    if model == "vit":
        config = transformers.ViTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=8,
            patch_size=4,
            num_labels=3,
        )

        def build() -> nn.Module:
            return transformers.ViTForImageClassification(config)

        path = (
            "model.vit.layers" if hasattr(Holder(build).model.vit, "layers") else "model.vit.encoder.layer"
        )  # older releases
    else:
        config = transformers.BertConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=50,
            max_position_embeddings=16,
        )
        build, path = (lambda: transformers.BertForMaskedLM(config)), "model.bert.encoder.layer"
    meta = init_like_pipeline(on_meta(build), seed=0, sequential=path)
    eager = Holder(build)
    for name, value in dict(meta.named_buffers()).items():
        torch.testing.assert_close(value, dict(eager.named_buffers())[name], rtol=0, atol=0, msg=name)
    for name, value in meta.state_dict().items():
        assert not value.is_meta and not (value.is_floating_point() and bool(value.isnan().any())), name
    if model == "vit":
        assert 0.01 < float(meta.model.vit.embeddings.cls_token.std()) < 0.03


def test_an_init_hook_replaces_the_rule() -> None:
    """init= is called on every module, children first, seeded per layer as the default rule."""
    seen: list[str] = []

    def init(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        for t in module.parameters(recurse=False):
            nn.init.normal_(t, std=0.5)

    meta = on_meta(gpt2())
    check_initializable(meta)
    materialize(meta, blocks(meta, "gpt2"), [0, *ENDS], "cpu", seed=1, init=init)
    assert abs(float(meta.model.transformer.wte.weight.detach().std()) - 0.5) < 0.05
    assert float(meta.model.transformer.h[0].ln_1.weight.detach().std()) > 0.1  # not HF's ones
    assert seen.index("GPT2Attention") > seen.index("Conv1D") and "GPT2LMHeadModel" in seen and "Holder" in seen
    again = on_meta(gpt2())
    materialize(again, blocks(again, "gpt2"), [0, *ENDS], "cpu", seed=1, init=init)
    assert torch.equal(again.model.transformer.h[0].attn.c_attn.weight, meta.model.transformer.h[0].attn.c_attn.weight)
