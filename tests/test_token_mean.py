"""Language-model losses that average over valid tokens (labels other than -100): with
``loss_weight=token_count(...)`` the pipeline trains on the whole batch's token mean and logs it,
as plain training on the whole batch does. An unchanged Hugging Face GPT-2 (HF shifts the labels)
and the BERT recipe's masked LM (``F.cross_entropy(..., ignore_index=-100)``), labels left out
differently in every micro-batch, one micro-batch without any label."""

from __future__ import annotations

import copy
import json
from typing import Any

import lightning as L
import pytest
import torch

pytest.importorskip("transformers")

from lightning_pipe import token_count
from lightning_pipe.recipes.bert import BertMLM
from tests.hf_models import HFModule, gpt2, padded_token_data
from tests.models import RecordMetrics, fit_plain
from tests.pipeline import assert_same_weights, fit_pipeline


class _BertMLM(BertMLM):
    """The BERT recipe's masked LM, tiny, with plain SGD (AdamW magnifies float noise)."""

    def __init__(self, microbatches: int = 1, tie_embeddings: bool = True) -> None:
        super().__init__(vocab_size=96, max_len=12, dropout=0.0, hidden=32, num_layers=2, build="eager",
                         tie_embeddings=tie_embeddings)  # fmt: skip
        self.microbatches = microbatches  # > 1: the control, each micro-batch's token mean weighted by its size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.microbatches == 1:
            return super().training_step(batch, batch_idx)
        parts = zip(*(t.tensor_split(self.microbatches) for t in batch))
        return sum(self._loss(part) * (len(part[0]) / len(batch[0])) for part in parts)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


#: name -> (the module, its strategy options with the token count)
MODELS: dict[str, tuple[Any, dict[str, Any]]] = {
    "gpt2": (
        lambda **kw: HFModule(gpt2, **kw),
        {"module": "model.transformer.h", "loss_weight": token_count(labels=1)},
    ),
    "bert_mlm": (_BertMLM, {"loss_weight": token_count(labels=2, shift=False)}),
}


def _fit_both(name: str, tmp_path, with_count: bool) -> tuple[L.LightningModule, L.LightningModule, dict, dict]:
    build, options = MODELS[name]
    options = options if with_count else {k: v for k, v in options.items() if k != "loss_weight"}
    torch.manual_seed(0)
    piped = build()
    reference = copy.deepcopy(piped)
    val = padded_token_data(name, n=24, seed=1)
    plain = fit_plain(reference, padded_token_data(name), val, val_check_interval=3)
    fit_pipeline(piped, 2, padded_token_data(name), val, chunks=4, val_check_interval=3,
                 callbacks=[RecordMetrics(str(tmp_path))], **options)  # fmt: skip
    logged = json.loads((tmp_path / "rank0.json").read_text())
    assert logged == json.loads((tmp_path / "rank1.json").read_text())
    return reference, piped, {k: float(v) for k, v in plain.callback_metrics.items()}, logged


@pytest.mark.parametrize("name", sorted(MODELS))
def test_token_count_trains_and_logs_the_whole_batchs_token_mean(name: str, tmp_path) -> None:
    reference, piped, plain, logged = _fit_both(name, tmp_path, with_count=True)
    assert_same_weights(reference, piped)
    assert sorted(logged) == ["train_loss", "val_loss"]
    assert logged == pytest.approx(plain, rel=1e-5)


def _largest_relative_difference(a: torch.nn.Module, b: torch.nn.Module, start: dict[str, torch.Tensor]) -> float:
    """The largest over tensors of |a - b| / |a - start|: how far apart the two trainings' updates are."""
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k] - sb[k]).norm() / (sa[k] - start[k]).norm().clamp_min(1e-12)) for k in sa)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_default_weights_each_microbatchs_token_mean_by_its_samples(name: str, tmp_path) -> None:
    """Without ``loss_weight`` the batch's loss is the micro-batches' token means weighted by their
    sizes: the weights equal plain training with that loss (the control), not whole-batch training."""
    reference, piped, _, _ = _fit_both(name, tmp_path, with_count=False)
    torch.manual_seed(0)
    control = MODELS[name][0](microbatches=4)
    start = copy.deepcopy(control.state_dict())
    fit_plain(control, padded_token_data(name))
    assert_same_weights(control, piped)
    difference = _largest_relative_difference(reference, piped, start)
    print(f"{name}: the default is {difference:.1%} off whole-batch training")
    assert difference > 0.05


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw"])
def test_asynchronous_schedules_log_the_first_batchs_token_mean(schedule: str, tmp_path) -> None:
    """An asynchronous schedule's first batch runs on the initial weights: its logged loss is the
    batch's token mean, as plain training's first step (later steps use stale weights by design).
    The BERT recipe's model untied: these schedules keep weight versions of the Sequential only."""
    torch.manual_seed(0)
    piped = _BertMLM(tie_embeddings=False)
    reference = copy.deepcopy(piped)
    plain = fit_plain(reference, padded_token_data("bert_mlm"), max_steps=1)
    fit_pipeline(piped, 2, padded_token_data("bert_mlm"), schedule=schedule, chunks=4, max_steps=1,
                 callbacks=[RecordMetrics(str(tmp_path))], **MODELS["bert_mlm"][1])  # fmt: skip
    for rank in range(2):
        logged = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert logged["train_loss"] == pytest.approx(float(plain.callback_metrics["train_loss"]), rel=1e-5)
