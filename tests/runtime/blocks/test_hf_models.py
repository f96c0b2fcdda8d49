"""Unchanged Hugging Face models under the pipeline (``module=`` a block container): the same
weights as plain Lightning training of the same model after 6 steps."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf_models import MODELS, BesideModule, HFModule, data_for
from tests.models import RecordHeld, fit_plain
from tests.pipeline import assert_same_weights, fit_pipeline

#: AdamW divides by the root of tiny second moments, which magnifies the float noise of summing a
#: gradient in another order to about its learning rate where gradients are near zero. Under AdamW
#: the pipeline's largest difference from plain training must stay within this factor of the
#: control's: plain training whose loss is summed over the same micro-batches (measured on these
#: models: 1.1e-5 to 1.7e-4 for the control, 7.2e-6 to 1.3e-4 for the pipeline).
ADAMW_NOISE_FACTOR = 4.0


def _largest_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


def _parity(
    name: str, devices: int, optimizer: str = "sgd", stages: int | None = None, layers: int = 4, **options: Any
) -> None:
    build, path = MODELS[name]
    torch.manual_seed(0)
    piped = HFModule(lambda: build(layers), optimizer=optimizer)
    reference = copy.deepcopy(piped)
    control = copy.deepcopy(piped)
    replicas = devices // (stages or devices)
    fit_plain(reference, data_for(name, batch_size=8 * replicas))
    fit_pipeline(piped, devices, data_for(name, batch_size=8), module=path, stages=stages, **options)
    if optimizer == "sgd":
        assert_same_weights(reference, piped)
        return
    control.microbatches = 4
    fit_plain(control, data_for(name, batch_size=8 * replicas))
    noise = _largest_difference(control, reference)
    assert _largest_difference(piped, reference) <= ADAMW_NOISE_FACTOR * max(noise, 1e-6), noise


@pytest.mark.parametrize(
    "name, devices, options",
    [
        ("gpt2", 2, {"schedule": "1f1b"}),
        ("llama_gqa_tied", 2, {"schedule": "zero_bubble", "optimizer": "adamw"}),
        ("llama_gqa_untied", 4, {"schedule": "1f1b", "recompute": "always"}),
        ("vit", 2, {"schedule": "interleaved_1f1b"}),
        ("gpt2", 4, {"schedule": "1f1b", "stages": 2}),
    ],
    ids=["gpt2-2-1f1b", "llama_tied-2-zb-adamw", "llama_untied-4-ckpt", "vit-2-interleaved", "gpt2-2x2-replicas"],
)
def test_an_unchanged_hf_model_trains_as_plain(name: str, devices: int, options: dict) -> None:
    _parity(name, devices, **options)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "interleaved_1f1b"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_parity_grid(name: str, devices: int, schedule: str, optimizer: str) -> None:
    layers = 8 if schedule == "interleaved_1f1b" and devices == 4 else 4  # 2 stages per process
    _parity(name, devices, optimizer=optimizer, schedule=schedule, layers=layers)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("options", [{"recompute": "always"}, {"stages": 2}], ids=["always", "2x2"])
def test_the_parity_grid_recomputation_and_replicas(name: str, options: dict) -> None:
    _parity(name, 4 if "stages" in options else 2, schedule="1f1b", **options)


@pytest.mark.parametrize("devices", [2, 4])
def test_a_model_kept_beside_its_sequential_trains_its_tie_once_and_keeps_only_its_stage(
    tmp_path: Path, devices: int
) -> None:
    """``self.hf`` beside ``self.layers`` (a Sequential of the same modules): every parameter has two
    names; the tie (embedding = head) spans the first and last stage. The gradient is plain
    training's, not twice it, and no rank keeps another stage's blocks through ``self.hf``."""
    torch.manual_seed(0)
    piped = BesideModule(layers=4)
    reference = copy.deepcopy(piped)
    whole = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in reference.state_dict().values()}.values())
    fit_plain(reference, data_for("gpt2"))
    fit_pipeline(piped, devices, data_for("gpt2"), module="layers", callbacks=[RecordHeld(str(tmp_path))])
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(
            piped.state_dict()[name], value, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
    held = [json.loads((tmp_path / f"held{r}.json").read_text()) for r in range(devices)]
    block = sum(p.numel() * 4 for p in reference.hf.transformer.h[0].parameters())
    for r, rank in enumerate(held):
        blocks = {n.split(".")[3] for n in rank["names"] if n.startswith("hf.transformer.h.")}
        blocks |= {
            n.split(".")[1] for n in rank["names"] if n.startswith("layers.") and n.split(".")[1] not in ("0", "5")
        }
        assert len(blocks) <= 4 // devices + 1, (r, rank["names"])
        assert rank["bytes"] < whole - (4 - 4 // devices) * block * 0.99, (r, rank["bytes"], whole)


@pytest.mark.parametrize(
    "devices, classify, options",
    [
        (2, True, {"schedule": "1f1b"}),
        pytest.param(4, True, {"schedule": "1f1b"}, marks=pytest.mark.slow),
        pytest.param(2, True, {"schedule": "interleaved_1f1b"}, marks=pytest.mark.slow),
        pytest.param(2, False, {"schedule": "1f1b"}, marks=pytest.mark.slow),
    ],
    ids=["classification-2-1f1b", "classification-4-1f1b", "classification-2-interleaved", "model-2-1f1b"],
)
def test_swin_trains_as_plain(devices: int, classify: bool, options: dict) -> None:
    """Swin's loop unpacks each of its stages' full output (``hidden, reshaped, _ = stage(...)``) and reads
    ``stage.downsample``: another process's stage answers its output's structure and its submodules' structure.
    SwinForImageClassification, and SwinModel under a classifier of the module's own (module="model.encoder.layers")."""
    from tests.hf_models import PooledSwin, swin

    torch.manual_seed(0)
    piped = HFModule(swin) if classify else PooledSwin()
    reference = copy.deepcopy(piped)
    fit_plain(reference, data_for("swin"))
    path = "model.swin.encoder.layers" if classify else "model.encoder.layers"
    fit_pipeline(piped, devices, data_for("swin"), module=path, **options)
    # the patch embedding's bias, near zero, ends up to 1.1e-6 from plain training (the summing order of its
    # gradient over 4 or 8 micro-batches); every other weight within the default tolerance
    assert_same_weights(reference, piped, atol=2e-6)


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa_untied"])
def test_the_embeddings_live_on_the_end_stages_only(tmp_path: Path, name: str) -> None:
    """4 stages: the input embeddings on the first, the head on the last (a tied one there too, as the
    head's weight), neither on the middle two, whose model gets shapes from a stand-in."""
    build, path = MODELS[name]
    torch.manual_seed(0)
    piped = HFModule(build)
    reference = copy.deepcopy(piped)
    fit_plain(reference, data_for(name))
    fit_pipeline(piped, 4, data_for(name), module=path, callbacks=[RecordHeld(str(tmp_path))])
    assert_same_weights(reference, piped)
    embedding = "model.transformer.wte.weight" if name == "gpt2" else "model.model.embed_tokens.weight"
    head = "model.lm_head.weight"
    names = [set(json.loads((tmp_path / f"held{r}.json").read_text())["names"]) for r in range(4)]
    assert embedding in names[0] and head not in names[0]
    assert not {embedding, head} & (names[1] | names[2])
    assert head in names[3] and embedding not in names[3]  # GPT-2's tie: the head's name for the same tensor


def test_plan_auto_plans_a_block_container_and_trains_as_plain() -> None:
    """The planner profiles the blocks as balance='time' does and ranks the synchronous schedules (on 2
    processes Chimera is not ranked: see its ``planned_from``); its choice trains as plain."""
    _parity("gpt2", 2, plan="auto", layers=6)


@pytest.mark.parametrize("balance", ["time", "memory"])
def test_measured_balances_split_the_blocks_and_train_as_plain(balance: str) -> None:
    """The blocks profiled on the arguments the model's forward gives them, then the split trains as
    plain (a model built in configure_model(): tests/partition/stages/test_hf_large.py)."""
    _parity("llama_gqa_untied", 2, balance=balance, layers=6)


@pytest.mark.parametrize(
    "name, devices",
    [
        ("llama_gqa_untied", 2),
        pytest.param("llama_gqa_tied", 2, marks=pytest.mark.slow),
        pytest.param("llama_gqa_untied", 4, marks=pytest.mark.slow),
        pytest.param("gpt2", 4, marks=pytest.mark.slow),
    ],
)
def test_chimera_copies_a_block_container_with_its_ends_and_trains_as_plain(name: str, devices: int) -> None:
    """Chimera's two pipelines each run every split stage: the processes holding the first and last
    stages hold the embeddings and the head (the tied one too) for both, and sum their gradients."""
    _parity(name, devices, schedule="chimera", chunks=4)


@pytest.mark.parametrize("name", ["llama_gqa_tied", "gpt2", pytest.param("bert_mlm", marks=pytest.mark.slow)])
def test_checkpoints_resume_under_the_pipeline_and_consolidate_for_plain_lightning(tmp_path: Path, name: str) -> None:
    """2 pipeline steps (AdamW) on 2 stages, saved; resumed on 4 stages for 2 more, saved again;
    consolidated, then 2 plain steps: the weights equal 6 plain steps. The tie between the first
    stage's embedding and the last stage's head is one entry of the consolidated optimizer."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_pipe.checkpoint import consolidate

    build, path = MODELS[name]
    data = data_for(name, n=16, batch_size=8)  # two steps per epoch
    torch.manual_seed(0)
    initial = HFModule(build, optimizer="adamw").state_dict()

    def fresh() -> HFModule:
        module = HFModule(build, optimizer="adamw")
        module.load_state_dict(initial)
        return module

    plain = fresh()
    fit_plain(plain, data, max_steps=-1, max_epochs=3)
    first, second = tmp_path / "first", tmp_path / "second"
    common = dict(module=path, max_steps=-1, enable_checkpointing=True)
    fit_pipeline(
        fresh(),
        2,
        data,
        max_epochs=1,
        callbacks=[ModelCheckpoint(dirpath=first, save_last=True, save_top_k=0)],
        **common,
    )
    fit_pipeline(fresh(), 4, data, max_epochs=2, ckpt_path=str(first / "last.ckpt"),
                 callbacks=[ModelCheckpoint(dirpath=second, save_last=True, save_top_k=0)], **common)  # fmt: skip
    merged = consolidate(second / "last.ckpt", tmp_path / "plain.ckpt")
    assert len(merged["optimizer_states"][0]["state"]) == len(list(plain.parameters()))  # the tie once
    resumed = fresh()
    fit_plain(resumed, data, ckpt_path=str(tmp_path / "plain.ckpt"), max_steps=-1, max_epochs=3)
    control = fresh()
    control.microbatches = 4
    fit_plain(control, data, max_steps=-1, max_epochs=3)
    noise = _largest_difference(control, plain)
    assert _largest_difference(resumed, plain) <= ADAMW_NOISE_FACTOR * max(noise, 1e-6), noise
