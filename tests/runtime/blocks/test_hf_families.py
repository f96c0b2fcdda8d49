"""Every model family of the docs' table (``docs/models.md``) under the pipeline, each as a tiny
configuration: the same weights as plain training after 6 steps, on 2 and 4 stages under 1F1B,
ZB-H1 and interleaved 1F1B (slow), a few of them in the default run; the refused ones refused
before any weight changes. The table is checked against :data:`GRID` here."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf_families import (
    BY_NAME,
    DOCS,
    FAMILIES,
    SCHEDULES,
    STAGES,
    TABLE_BEGIN,
    TABLE_END,
    WEIGHTS_STAGES,
    Family,
    FamilyModule,
    family_data,
    family_table,
)
from tests.models import fit_plain, plain_trainer
from tests.pipeline import assert_same_weights, fit_pipeline, pipeline_trainer

#: what the slow grid verifies for every family that trains (the docs' table says the same)
GRID = [
    (f.name, devices, schedule)
    for f in FAMILIES
    if not f.refused and not f.compared
    for devices in STAGES
    for schedule in SCHEDULES
]


def parity(family: Family, devices: int, schedule: str, **options: Any) -> None:
    layers = 8 if schedule == "interleaved_1f1b" and devices == 4 else 4  # 2 stages per process
    torch.manual_seed(0)
    piped = FamilyModule(lambda: family.build(layers))
    assert type(piped.model) is family.model  # what the docs' table names
    reference = copy.deepcopy(piped)
    fit_plain(reference, family_data(family))
    fit_pipeline(piped, devices, family_data(family), module=family.module, schedule=schedule, **options)
    assert_same_weights(reference, piped)


@pytest.mark.parametrize(
    "name, devices, schedule",
    [
        ("BERT masked LM (tied)", 2, "1f1b"),
        ("DistilBERT masked LM (tied)", 4, "zero_bubble"),
        ("RoBERTa masked LM (tied)", 2, "interleaved_1f1b"),
    ],
)
def test_a_masked_lm_whose_head_bias_has_two_names_trains_as_plain(name: str, devices: int, schedule: str) -> None:
    """The head's bias is one parameter under two names (``cls.predictions.bias`` and
    ``cls.predictions.decoder.bias``; RoBERTa's ``lm_head.bias``): it belongs to the last stage alone,
    and the stages agree on the parameters outside the blocks (before: gloo's "collective mismatch"
    abort). DistilBERT's head has its tie alone."""
    model = BY_NAME[name].build(1)
    head = model.get_output_embeddings()
    assert head.weight is model.get_input_embeddings().weight  # HF's default: tied
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is head.bias]
    assert len(names) == (1 if name.startswith("DistilBERT") else 2), names
    parity(BY_NAME[name], devices, schedule)


def test_an_encoder_decoder_split_by_its_encoder_trains_as_plain() -> None:
    """Whisper: the outer model's input embeddings are the decoder's, which run after the encoder's
    blocks, on the last stage (before: a stand-in's zeros there, 3e-2 off after 6 steps); the
    decoder's embedding is tied to the head, and every stage keeps both. ViT + GPT-2 (the same
    before, 6e-2 off) is in the slow grid."""
    parity(BY_NAME["Whisper (split by its encoder)"], 2, "1f1b")


@pytest.mark.parametrize("name", ["BART (split by its encoder)", "BART (split by its decoder)"])
def test_bart_trains_as_plain_where_a_process_holds_neither_end(name: str) -> None:
    """DualPipeV on 2 processes: each holds a middle stage, which runs the encoder's embedding, one
    weight with the decoder's and the head's (before: ``'BartScaledWordEmbedding' object has no
    attribute 'weight'`` in the first forward)."""
    parity(BY_NAME[name], 2, "dualpipev")


@pytest.mark.slow
@pytest.mark.parametrize("name, devices, schedule", GRID, ids=[f"{n}-{d}-{s}" for n, d, s in GRID])
def test_every_family_trains_as_plain(name: str, devices: int, schedule: str) -> None:
    parity(BY_NAME[name], devices, schedule)


def test_stages_that_would_sum_different_outside_parameters_are_refused_at_setup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever makes the stages list different parameters outside the blocks (here: the head's bias
    left on the first stage under its second name, as before it was released there), the run stops at
    setup with the names, not with gloo's abort in the first step's sum."""
    import lightning_pipe.assembly.split

    monkeypatch.setattr(lightning_pipe.assembly.split, "release_parameters", lambda slots: [])  # fork: the children too
    family = BY_NAME["BERT masked LM (tied)"]
    with pytest.raises(
        Exception, match=r"disagree on the parameters outside the split layers.*model\.cls\.predictions\.bias"
    ):
        fit_pipeline(FamilyModule(family.build), 2, family_data(family), module=family.module)


@pytest.mark.parametrize(
    "module, processes, schedule",
    [
        ("model.encoder.block", 2, "1f1b"),
        pytest.param("model.decoder.block", 2, "1f1b", marks=pytest.mark.slow),  # the encoder runs on every stage
        pytest.param("model.encoder.block", 4, "1f1b", marks=pytest.mark.slow),  # through 2 middle stages
        pytest.param("model.decoder.block", 4, "zero_bubble", marks=pytest.mark.slow),
        pytest.param("model.encoder.block", 2, "zbv", marks=pytest.mark.slow),
        pytest.param("model.decoder.block", 4, "1f1b", marks=pytest.mark.slow),
        pytest.param("model.encoder.block", 4, "chimera", marks=pytest.mark.slow),  # both directions carry the bias
    ],
    ids=[
        "encoder-2p",
        "decoder-2p",
        "encoder-4p",
        "decoder-4p-zb",
        "encoder-2p-zbv",
        "decoder-4p",
        "encoder-4p-chimera",
    ],
)
def test_t5_whose_blocks_pass_position_biases_on_trains_as_plain(module: str, processes: int, schedule: str) -> None:
    """T5's block 0 computes the position bias (the decoder's also the cross-attention's) and the loop
    hands it to every later block: it crosses stages after the hidden state, the stand-ins of earlier
    blocks return it in the block's structure, and its gradient reaches block 0's relative attention
    bias (before: refused, naming block 2 and its 'position_bias')."""
    family = BY_NAME["T5"]
    torch.manual_seed(0)
    piped = FamilyModule(family.build)
    reference = copy.deepcopy(piped)
    fit_plain(reference, family_data(family))
    fit_pipeline(piped, processes, family_data(family), module=module, schedule=schedule)
    assert_same_weights(reference, piped)


WEIGHTS_GRID = [f.name for f in FAMILIES if not f.refused and not f.compared]


def starts_from_save_pretrained(tmp_path: Path, family: Family) -> None:
    """``weights=`` what ``save_pretrained`` wrote (in several shards), on 2 stages: the pipeline's
    weights after 6 steps equal plain training of ``from_pretrained``'s model; transformers converts
    the names of the families whose row says so, and so does the load."""
    from lightning_pipe.weights.hf import PretrainedFiles
    from lightning_pipe.weights.hf_conversion import conversion_of

    torch.manual_seed(3)
    saved = family.build()
    saved.save_pretrained(tmp_path / "saved", max_shard_size="200KB")
    conversion = conversion_of(saved)
    names = list(PretrainedFiles(tmp_path / "saved").shapes)
    assert (conversion is not None and conversion.converts(names)) == bool(family.converted)
    torch.manual_seed(0)
    piped = FamilyModule(family.build)  # other values: the file must replace every one
    reference = FamilyModule(lambda: type(saved).from_pretrained(tmp_path / "saved"))
    for held, built in zip(reference.parameters(), piped.parameters(), strict=True):
        held.requires_grad_(
            built.requires_grad
        )  # from_pretrained unfreezes Whisper's embed_positions; weights= loads values
    fit_plain(reference, family_data(family))
    fit_pipeline(piped, WEIGHTS_STAGES, family_data(family), module=family.module, weights=str(tmp_path / "saved"))
    assert_same_weights(reference, piped)


def test_a_mixture_of_experts_starts_from_its_save_pretrained_directory(tmp_path: Path) -> None:
    """Mixtral's directory holds one tensor per expert and projection, which transformers stacks when
    it loads them; each stage converts its own the same way (before: refused as names that do not fit)."""
    starts_from_save_pretrained(tmp_path, BY_NAME["Mixtral (auxiliary loss off)"])


@pytest.mark.slow
@pytest.mark.parametrize("name", WEIGHTS_GRID)
def test_every_family_starts_from_a_save_pretrained_directory(tmp_path: Path, name: str) -> None:
    starts_from_save_pretrained(tmp_path, BY_NAME[name])


def test_the_docs_table_is_the_one_the_families_and_the_grid_give() -> None:
    """docs/models.md lists every family with what the tests above run for it; after changing
    either, regenerate it with ``python -m tests.hf_families``."""
    text = (Path(__file__).resolve().parents[3] / DOCS).read_text()
    assert TABLE_BEGIN in text and TABLE_END in text
    written = text[text.index(TABLE_BEGIN) : text.index(TABLE_END) + len(TABLE_END)]
    assert written == family_table(), "docs/models.md is out of date: run python -m tests.hf_families"
    assert {n for n, _, _ in GRID} == {f.name for f in FAMILIES if not f.refused and not f.compared}
    assert {(d, s) for _, d, s in GRID} == {(d, s) for d in STAGES for s in SCHEDULES}


class DeferredBertMLM(FamilyModule):
    """BERT's masked LM built in configure_model(): on the meta device under the pipeline."""

    def __init__(self) -> None:
        super().__init__(lambda: None)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = BY_NAME["BERT masked LM (tied)"].build()


def test_a_meta_built_masked_lm_initialises_its_head_and_keeps_the_bias_on_the_last_stage_only(tmp_path: Path) -> None:
    """HF's own initialisation of the head sets ``cls.predictions.bias`` on every stage that builds
    the head's module; the stages that do not hold the decoder release it after, found by identity
    before materialising gave the tensors new ones."""
    import json

    from tests.models import RecordHeld

    family = BY_NAME["BERT masked LM (tied)"]
    fit_pipeline(DeferredBertMLM(), 2, family_data(family), module=family.module, callbacks=[RecordHeld(str(tmp_path))])
    first, last = (set(json.loads((tmp_path / f"held{r}.json").read_text())["names"]) for r in range(2))
    assert "model.cls.predictions.bias" not in first and "model.cls.predictions.decoder.weight" not in first
    assert "model.cls.predictions.bias" in last  # the first name of the decoder's bias there


def test_a_classifier_whose_forward_records_hidden_states_it_drops_trains_as_plain() -> None:
    """transformers' ``filter_output_hidden_states`` turns the recording of every layer's hidden
    state on whatever the caller asked, and drops them from the output; Wav2Vec2's head reads only
    the last (before: refused as a read of other stages' blocks, with advice that could not help).
    HuBERT's (the same before) is in the slow grid."""
    parity(BY_NAME["Wav2Vec2 sequence classification"], 2, "1f1b")


@pytest.mark.parametrize(
    "name", ["Wav2Vec2 sequence classification", pytest.param("HuBERT sequence classification", marks=pytest.mark.slow)]
)
def test_a_classifier_that_sums_every_layers_hidden_state_trains_as_plain(name: str) -> None:
    """``use_weighted_layer_sum=True``: the head reads every layer's hidden state, which transformers
    records whatever the call asks; they cross stages with the micro-batch (before: refused), in
    ``fit``, ``validate`` and ``predict``."""
    family = BY_NAME[name]
    torch.manual_seed(0)
    piped = FamilyModule(lambda: family.build(4, use_weighted_layer_sum=True))
    reference = copy.deepcopy(piped)
    fit_plain(reference, family_data(family))
    fit_pipeline(piped, 2, family_data(family), module=family.module)
    assert_same_weights(reference, piped)
    val = family_data(family, n=16, seed=1)
    plain = plain_trainer().validate(reference, val, verbose=False)[0]["val_loss"]
    piped_val = pipeline_trainer(2, module=family.module).validate(piped, val, verbose=False)[0]["val_loss"]
    assert piped_val == pytest.approx(plain, rel=1e-5)
    predicted = torch.cat(pipeline_trainer(2, module=family.module).predict(piped, val))
    torch.testing.assert_close(predicted, torch.cat(plain_trainer().predict(reference, val)), rtol=1e-4, atol=1e-5)
    weights = piped.model.layer_weights
    assert not torch.allclose(weights, torch.full_like(weights, weights[0].item()))  # every layer's weight moved apart
