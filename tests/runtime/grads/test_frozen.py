"""Frozen and unused parameters under the pipeline: left exactly as plain training leaves them (no
weight decay on a parameter without a gradient), and a stage with nothing to train still runs its
part of every step."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

from tests.models import (
    FrozenOutsideNet,
    FrozenStartInfNet,
    FrozenStartNet,
    FrozenTieNet,
    RecordEpochs,
    TinyNet,
    fit_plain,
    loader,
    token_loader,
)
from tests.pipeline import assert_same_weights, fit_pipeline


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_frozen_and_unused_parameters_outside_the_blocks_are_not_decayed(optimizer: str) -> None:
    torch.manual_seed(0)
    piped = FrozenOutsideNet(optimizer)
    start = copy.deepcopy(piped.state_dict())
    reference = copy.deepcopy(piped)
    fit_plain(reference)
    fit_pipeline(piped, 2, module="blocks")
    assert_same_weights(reference, piped)
    for name in ("norm.weight", "norm.bias", "unused.weight", "unused.bias"):  # no gradient: untouched
        assert torch.equal(piped.state_dict()[name], start[name]), name
    assert not torch.equal(piped.state_dict()["embed.weight"], start["embed.weight"])


def test_a_frozen_weight_tied_across_stages_is_not_decayed() -> None:
    """The embedding tied to the head, frozen: no copy gets a gradient, so neither is decayed."""
    torch.manual_seed(0)
    piped = FrozenTieNet()
    start = piped.layers[0].weight.detach().clone()
    reference = copy.deepcopy(piped)
    fit_plain(reference, token_loader())
    fit_pipeline(piped, 2, token_loader())
    assert_same_weights(reference, piped)
    assert torch.equal(piped.layers[0].weight, start)


def test_a_stage_with_nothing_to_train_runs_its_part_and_resumes(tmp_path: Path) -> None:
    """Stage 0 holds only frozen layers, and its optimizer gets no parameter (plain training's
    optimizer gets the trainable ones); clipping takes the norm over both stages, and a checkpoint
    with the empty optimizer resumes."""
    torch.manual_seed(0)
    piped = FrozenStartNet()
    start = copy.deepcopy(piped.state_dict())
    reference = copy.deepcopy(piped)
    epochs = {"max_steps": -1, "gradient_clip_val": 0.5}
    fit_plain(reference, loader(n=36), max_epochs=2, **epochs)
    save = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit_pipeline(piped, 2, loader(n=36), max_epochs=1, enable_checkpointing=True, callbacks=[save], **epochs)
    resumed = FrozenStartNet()
    fit_pipeline(resumed, 2, loader(n=36), max_epochs=2, ckpt_path=str(tmp_path / "last.ckpt"), **epochs)
    assert_same_weights(reference, resumed)
    for name in ("layers.0.weight", "layers.2.bias"):
        assert torch.equal(resumed.state_dict()[name], start[name]), name


def test_a_stage_with_nothing_to_train_takes_the_gradient_scalers_verdict(tmp_path: Path) -> None:
    """``16-mixed``: an inf on the last stage at step 2 skips that step on every stage; the frozen
    stage's scaler (whose optimizer has no gradient to check) backs off with the others'."""
    torch.manual_seed(0)
    piped = FrozenStartInfNet()
    reference = copy.deepcopy(piped)
    fp16 = lambda: MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))  # noqa: E731
    (tmp_path / "plain").mkdir()
    fit_plain(reference, plugins=[fp16()], callbacks=[RecordEpochs(str(tmp_path / "plain"))])
    fit_pipeline(piped, 2, plugins=[fp16()], callbacks=[RecordEpochs(str(tmp_path))])
    scales = [json.loads((tmp_path / f"end{r}.json").read_text())["scale"] for r in range(2)]
    assert scales == [json.loads((tmp_path / "plain" / "end0.json").read_text())["scale"]] * 2 == [65536.0 * 0.5] * 2
    assert_same_weights(reference, piped, rtol=1e-2, atol=1e-3)


class _NothingToTrain(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.requires_grad_(False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def test_a_model_with_nothing_to_train_is_refused_as_plain_training_refuses_it() -> None:
    with pytest.raises(Exception, match="optimizer got an empty parameter list"):
        fit_plain(_NothingToTrain())
    with pytest.raises(Exception, match="empty parameter list: configure_optimizers.. gave the optimizer no parameter"):
        fit_pipeline(_NothingToTrain(), 2)


transformers = pytest.importorskip("transformers")

from tests.hf_models import HFModule, data_for, llama  # noqa: E402
from tests.runtime.blocks.test_hf_models import ADAMW_NOISE_FACTOR, _largest_difference  # noqa: E402


def _llama_frozen_norm() -> torch.nn.Module:
    model = llama(False)
    model.model.norm.requires_grad_(False)
    return model


def test_llama_with_a_frozen_final_norm_under_adamw_weight_decay() -> None:
    """An untied Llama, its final norm frozen, ``AdamW(self.parameters(), weight_decay=0.01)``: the norm
    stays as it is, and the rest is plain training's within AdamW's float noise (the control: plain
    training summing 4 micro-batches' losses)."""
    torch.manual_seed(0)
    piped = HFModule(_llama_frozen_norm, optimizer="adamw")
    start = piped.model.model.norm.weight.detach().clone()
    reference, control = copy.deepcopy(piped), copy.deepcopy(piped)
    control.microbatches = 4
    fit_plain(reference, data_for("llama"))
    fit_plain(control, data_for("llama"))
    fit_pipeline(piped, 2, data_for("llama"), module="model.model.layers")
    assert torch.equal(piped.model.model.norm.weight, start)
    noise = _largest_difference(control, reference)
    assert _largest_difference(piped, reference) <= ADAMW_NOISE_FACTOR * max(noise, 1e-6), noise
