"""``data_parallel="shard"`` (FSDP2) for the models users bring: a Hugging Face model through
``module=`` keeps its embeddings, final norm and head outside the blocks. They are sharded with their
stage's blocks over the same replicas (GPT-2's and tied Llama's embedding, tied to the head across
the first and last stage, on both, its gradients summed shard by shard), and the run equals plain
training on the global batch, and resumes from its sharded checkpoint under another layout."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf_models import MODELS, HFModule, data_for
from tests.models import fit_plain
from tests.pipeline import assert_same_weights, fit_pipeline


@pytest.mark.parametrize(
    "name, schedule",
    [
        ("gpt2", "zero_bubble"),  # the embedding tied to the head; position embeddings and final norm on every stage
        # 1f1b: the resume test below trains GPT-2 under it, against plain training
        pytest.param("llama_gqa_untied", "1f1b", marks=pytest.mark.slow),
        pytest.param("gpt2", "1f1b", marks=pytest.mark.slow),
        pytest.param("llama_gqa_tied", "1f1b", marks=pytest.mark.slow),
        pytest.param("llama_gqa_tied", "zero_bubble", marks=pytest.mark.slow),
        pytest.param("llama_gqa_untied", "zero_bubble", marks=pytest.mark.slow),
    ],
)
def test_sharded_block_containers_train_as_plain_on_the_global_batch(name: str, schedule: str) -> None:
    build, path = MODELS[name]
    torch.manual_seed(0)
    piped = HFModule(build)
    reference, initial = copy.deepcopy(piped), copy.deepcopy(piped)
    fit_plain(reference, data_for(name, batch_size=16))
    sharded = dict(module=path, stages=2, data_parallel="shard", schedule=schedule)
    fit_pipeline(piped, 4, data_for(name, batch_size=8), **sharded)
    assert_same_weights(reference, piped)
    head = "model.lm_head.weight"
    assert not torch.allclose(initial.state_dict()[head], piped.state_dict()[head])


def test_a_sharded_block_container_resumes_under_another_layout(tmp_path: Path) -> None:
    """One epoch at 2 stages x 2 replicas (sharded), saved; the next on 4 stages of one replica:
    the weights of two plain epochs."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    build, path = MODELS["gpt2"]
    torch.manual_seed(0)
    initial = HFModule(build).state_dict()

    def fresh() -> HFModule:
        module = HFModule(build)
        module.load_state_dict(initial)
        return module

    plain = fresh()
    fit_plain(plain, data_for("gpt2", n=32, batch_size=16), max_steps=-1, max_epochs=2)
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    common = dict(module=path, max_steps=-1, enable_checkpointing=True)
    fit_pipeline(fresh(), 4, data_for("gpt2", n=32, batch_size=8), stages=2, data_parallel="shard", max_epochs=1,
                 callbacks=[saves], **common)  # fmt: skip
    assert (tmp_path / "last.ckpt" / "stage-00000.dcp").is_dir()  # every replica's shards
    resumed = fresh()
    fit_pipeline(resumed, 4, data_for("gpt2", n=32, batch_size=16), max_epochs=2, ckpt_path=str(tmp_path / "last.ckpt"),
                 **common)  # fmt: skip
    assert_same_weights(plain, resumed)


def _family_parity(name: str) -> None:
    """The family ``name`` at 2 stages x 2 sharded replicas equals plain training on the global batch, and
    every parameter that the loss reaches trained (those it does not: frozen or unused ones, such as
    Whisper's encoder positions or the vision block after the one LLaVA reads its features from)."""
    from tests.hf_families import BY_NAME, FamilyModule, family_data

    family = BY_NAME[name]
    torch.manual_seed(0)
    piped = FamilyModule(family.build)
    assert type(getattr(piped.model, "tower", piped.model)) is family.model  # what the docs' table names
    reference, initial = copy.deepcopy(piped), copy.deepcopy(piped)
    fit_plain(reference, family_data(family, batch_size=16))
    fit_pipeline(piped, 4, family_data(family, batch_size=8), module=family.module, stages=2, data_parallel="shard")
    assert_same_weights(reference, piped)
    start = {n: p.detach().clone() for n, p in initial.named_parameters()}
    initial(*next(iter(family_data(family, batch_size=16)))).loss.backward()
    reached = {n for n, p in initial.named_parameters() if p.grad is not None}

    def moved(module: torch.nn.Module) -> set[str]:
        return {n for n, p in module.named_parameters() if not torch.equal(p, start[n])}

    assert moved(reference) == moved(piped) == reached


#: the families of tests/hf_families.py trained sharded here (their rows of docs/models.md say "yes")
NESTED = [
    "ViT image classification",
    "Wav2Vec2 sequence classification",
    pytest.param("HuBERT sequence classification", marks=pytest.mark.slow),  # Wav2Vec2's weight norm
]
SHARED_EMBEDDINGS = [
    "BART (split by its encoder)",
    pytest.param("BART (split by its decoder)", marks=pytest.mark.slow),
    pytest.param("T5", marks=pytest.mark.slow),
    pytest.param("Whisper (split by its encoder)", marks=pytest.mark.slow),
    pytest.param("ViT + GPT-2 (split by its encoder)", marks=pytest.mark.slow),
]
MORE = [
    "SigLIP vision tower",
    "LLaVA",
    pytest.param("DINOv2", marks=pytest.mark.slow),
    pytest.param("BEiT", marks=pytest.mark.slow),
    pytest.param("CLIP vision tower", marks=pytest.mark.slow),
    pytest.param("CLIP text tower", marks=pytest.mark.slow),
    pytest.param("SigLIP text tower", marks=pytest.mark.slow),
    pytest.param("mBART (split by its encoder)", marks=pytest.mark.slow),
    pytest.param("mBART (split by its decoder)", marks=pytest.mark.slow),
    pytest.param("Pegasus", marks=pytest.mark.slow),
    pytest.param("Marian", marks=pytest.mark.slow),
]
BLOCK_CONTAINERS = {"gpt2": "GPT-2", "llama_gqa_tied": "Llama (tied embeddings)", "llama_gqa_untied": "Llama (untied)"}


@pytest.mark.parametrize("name", NESTED)
def test_sharded_models_holding_parameters_beside_their_children_train_as_plain(name: str) -> None:
    """ViT's embeddings hold the [CLS] token and position embeddings beside the patch convolution,
    their child; Wav2Vec2's positional convolution holds its bias beside its weight norm's parametrization.
    Neither is a tie: each module is sharded with what is nested in it, a parametrized weight with its
    module, and the run equals plain training on the global batch."""
    _family_parity(name)


@pytest.mark.parametrize("name", SHARED_EMBEDDINGS)
def test_sharded_encoder_decoders_whose_modules_share_an_embedding_train_as_plain(name: str) -> None:
    """BART's embedding is held by the model's ``shared``, the encoder's and decoder's ``embed_tokens`` and
    the head, several of them on one process: grouped into one FSDP2 unit, sharded once (T5 and Whisper
    alike; ViT + GPT-2's decoder ties its head to its embedding)."""
    _family_parity(name)


@pytest.mark.parametrize("name", MORE)
def test_more_sharded_families_train_as_plain(name: str) -> None:
    """SigLIP's vision tower pools through an attention head whose ``nn.MultiheadAttention`` reads its
    ``out_proj``'s weight without calling it: the head is one unit with everything nested in it (before:
    "got mixed torch.Tensor and DTensor" in the head's forward). LLaVA's vision tower runs outside the
    blocks on the first stage, its last block unused (LLaVA reads the one before): no parameter of it
    trains, in plain training or sharded. The others hold what the families above hold."""
    _family_parity(name)


def test_the_docs_table_says_shard_for_the_families_trained_here() -> None:
    from tests.hf_families import FAMILIES

    def names(params: list) -> set[str]:
        return {p if isinstance(p, str) else p.values[0] for p in params}

    here = names(NESTED) | names(SHARED_EMBEDDINGS) | names(MORE) | set(BLOCK_CONTAINERS.values())
    assert {f.name for f in FAMILIES if f.sharded} == here
