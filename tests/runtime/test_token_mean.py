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

from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import token_count
from lightning_pipe.recipes.bert import BertMLM
from tests.hf_models import DictBatchLM, HFModule, data_for, gpt2, llama, padded_dict_data, padded_token_data
from tests.models import RecordMetrics, RecordWarnings, fit_plain
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


def test_the_default_trains_a_padded_llama_fed_dict_batches_on_the_whole_batchs_token_mean(tmp_path) -> None:
    """A Hugging Face causal LM fed as Hugging Face feeds it (dict batches with ``labels``, right padding
    left out with -100) needs no ``loss_weight``: by default the micro-batches are weighted by their valid
    labels, and the weights and the logged loss equal plain training's on the whole batch; nothing warns."""
    torch.manual_seed(0)
    piped = DictBatchLM(lambda: llama(False))
    reference = copy.deepcopy(piped)
    plain = fit_plain(reference, padded_dict_data())
    fit_pipeline(piped, 2, padded_dict_data(), module="model.model.layers", chunks=4,
                 callbacks=[RecordMetrics(str(tmp_path)), RecordWarnings(str(tmp_path))])  # fmt: skip
    assert_same_weights(reference, piped)
    logged = json.loads((tmp_path / "rank0.json").read_text())
    assert logged["train_loss"] == pytest.approx(float(plain.callback_metrics["train_loss"]), rel=1e-5)
    for rank in range(2):
        assert not [w for w in json.loads((tmp_path / f"warnings{rank}.json").read_text()) if "-100" in w]


def _unpadded_then_padded() -> DataLoader:
    """GPT-2's batches of 8: the first two without padding, the next two padded (labels -100)."""
    full, padded = data_for("gpt2", n=16), padded_token_data("gpt2", n=16)
    columns = [torch.cat([a, b]) for a, b in zip(full.dataset.tensors, padded.dataset.tensors)]
    return DataLoader(TensorDataset(*columns), batch_size=8)


def test_the_default_warns_once_where_it_cannot_count_the_tokens(tmp_path) -> None:
    """A tuple batch (where its labels are is not known for sure): the default stays the samples, and rank
    0 warns once, at the first step whose micro-batches hold other shares of valid labels than of samples
    (step 2, the first padded batch), naming the ``token_count`` to give. A dense model: no MoE line."""
    torch.manual_seed(0)
    fit_pipeline(HFModule(gpt2), 2, _unpadded_then_padded(), module="model.transformer.h", chunks=4, max_epochs=2,
                 callbacks=[RecordWarnings(str(tmp_path))])  # fmt: skip
    warned = json.loads((tmp_path / "warnings0.json").read_text())
    told = [w for w in warned if "token_count" in w]
    assert len(told) == 1, warned
    assert "token_count(labels=1)" in told[0] and "first at global step 2" in told[0]
    assert not [w for w in json.loads((tmp_path / "warnings1.json").read_text()) if "token_count" in w]
    assert not [w for w in warned if "load-balancing" in w]
