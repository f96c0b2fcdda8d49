"""Data-parallel replicas of the pipeline (``stages`` x replicas processes).

Each replica reads its part of every step (a ``DistributedSampler``: replica j the samples
j, j+d, j+2d, ...), so d replicas with batch 12 see, per step, exactly the samples of one plain
batch of 12 d: the weights must equal plain single-process training on that global batch.
"""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch

from lightning_pipe import PipelineStrategy
from tests.models import RecordMetrics, TiedNet, TinyNet, WrappedNet, fit_plain, loader, token_loader
from tests.pipeline import assert_same_weights, fit_pipeline, twins


@pytest.mark.parametrize(
    "schedule, stages, devices",
    [("gpipe", 2, 4), ("1f1b", 2, 4), ("1f1b", 1, 4)],
    ids=["gpipe-2x2", "1f1b-2x2", "1f1b-1x4"],
)
def test_replicas_train_as_plain_training_on_the_global_batch(tmp_path, schedule: str, stages: int, devices: int) -> None:
    replicas = devices // stages
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference, loader(batch_size=12 * replicas))
    fit_pipeline(
        piped, devices, data=loader(batch_size=12), schedule=schedule, chunks=3, stages=stages,
        callbacks=[RecordMetrics(str(tmp_path))],
    )
    assert_same_weights(reference, piped)
    # the logged loss is the mean over the global batch, the same on every rank
    values = [json.load(open(tmp_path / f"rank{r}.json"))["train_loss"] for r in range(devices)]
    assert all(abs(v - values[0]) < 1e-6 for v in values), values


class _CountAllReduce(L.Callback):
    """Bytes each rank all-reduces over its stage's replicas, per optimizer step."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.steps: list[int] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import torch.distributed as dist

        group = trainer.strategy._topology.dp_group
        original = dist.all_reduce
        self.current = 0

        def counting(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
            if kwargs.get("group") is group and tensor.dtype == torch.float32:  # float64: the step's logged means
                self.current += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counting  # this process is a fork that ends with the fit

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.steps.append(self.current)
        self.current = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
        with open(os.path.join(self.folder, f"bytes{trainer.global_rank}.json"), "w") as f:
            json.dump({"steps": self.steps, "params": params}, f)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_rank_all_reduces_its_stage_once_per_step(tmp_path, schedule: str) -> None:
    """chunks=4 micro-batches per step, yet each step all-reduces the stage's gradients once."""
    torch.manual_seed(0)
    fit_pipeline(TinyNet(), 4, stages=2, schedule=schedule, chunks=4, max_steps=3, callbacks=[_CountAllReduce(str(tmp_path))])
    for rank in range(4):
        record = json.load(open(tmp_path / f"bytes{rank}.json"))
        assert record["params"] > 0
        assert record["steps"] == [record["params"]] * 3, (rank, record)


def test_stages_must_divide_the_world_size() -> None:
    with pytest.raises(ValueError, match=r"stages=3\) does not divide the world size 4"):
        L.Trainer(accelerator="cpu", devices=4, strategy=PipelineStrategy(stages=3, start_method="fork"))


@pytest.mark.parametrize("value, message", [(0, "stages=0"), ("2", "stages='2'")])
def test_bad_stages(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineStrategy(stages=value)  # type: ignore[arg-type]


def test_bad_data_parallel_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="replicate, shard"):
        PipelineStrategy(data_parallel="zero")
