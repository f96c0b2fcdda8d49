"""Data-parallel replicas of the pipeline (``stages`` x replicas processes).

Each replica reads its part of every step (a ``DistributedSampler``: replica j the samples
j, j+d, j+2d, ...), so d replicas with batch 12 see, per step, exactly the samples of one plain
batch of 12 d: the weights must equal plain single-process training on that global batch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_pipe import PipelineStrategy
from tests.models import RecordMetrics, TiedNet, TinyNet, WrappedNet, fit_plain, loader, token_loader
from tests.pipeline import assert_same_weights, fit_pipeline, twins


@pytest.mark.parametrize(
    "schedule, stages, devices",
    [
        ("gpipe", 2, 4),
        ("1f1b", 2, 4),
        ("1f1b", 1, 4),
        ("zero_bubble", 2, 4),
        ("interleaved_1f1b", 2, 4),
        ("zbv", 2, 4),
        ("interleaved_zero_bubble", 2, 4),
    ],
    ids=["gpipe-2x2", "1f1b-2x2", "1f1b-1x4", "zero_bubble-2x2", "interleaved-2x2", "zbv-2x2", "interleaved_zb-2x2"],
)
def test_replicas_train_as_plain_training_on_the_global_batch(
    tmp_path, schedule: str, stages: int, devices: int
) -> None:
    replicas = devices // stages
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference, loader(batch_size=12 * replicas))
    fit_pipeline(
        piped,
        devices,
        data=loader(batch_size=12),
        schedule=schedule,
        chunks=3,
        stages=stages,
        callbacks=[RecordMetrics(str(tmp_path))],
    )
    assert_same_weights(reference, piped)
    # the logged loss is the mean over the global batch, the same on every rank
    values = [json.loads((tmp_path / f"rank{r}.json").read_text())["train_loss"] for r in range(devices)]
    assert all(abs(v - values[0]) < 1e-6 for v in values), values


class _CountAllReduce(L.Callback):
    """Bytes each rank all-reduces over its stage's replicas, per optimizer step."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.steps: list[int] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import torch.distributed as dist

        group = trainer.strategy.pipeline.topology.dp_group
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
    fit_pipeline(
        TinyNet(), 4, stages=2, schedule=schedule, chunks=4, max_steps=3, callbacks=[_CountAllReduce(str(tmp_path))]
    )
    for rank in range(4):
        record = json.loads((tmp_path / f"bytes{rank}.json").read_text())
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


def _twins_fit(model_cls, data_fn, batch: int, replicas: int, devices: int, **options: object):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    reference, piped = twins(model_cls())
    plain_options = {
        k: v for k, v in options.items() if k in ("gradient_clip_val", "accumulate_grad_batches", "max_steps")
    }
    fit_plain(reference, data_fn(batch_size=batch * replicas), **plain_options)
    fit_pipeline(piped, devices, data=data_fn(batch_size=batch), **options)
    return reference, piped


@pytest.mark.parametrize(
    "case",
    ["tied-weights", "parameters-outside", "clip-by-global-norm", "accumulate"],
)
def test_features_with_replicas_match_plain_training(case: str) -> None:
    if case == "tied-weights":
        reference, piped = _twins_fit(TiedNet, token_loader, 12, 2, 4, stages=2, schedule="1f1b", chunks=3)
    elif case == "parameters-outside":
        reference, piped = _twins_fit(WrappedNet, loader, 12, 2, 4, stages=2, schedule="gpipe", chunks=3)
    elif case == "clip-by-global-norm":
        reference, piped = _twins_fit(TinyNet, loader, 12, 2, 4, stages=2, chunks=3, gradient_clip_val=0.05)
    else:
        reference, piped = _twins_fit(TinyNet, loader, 12, 2, 4, stages=2, chunks=3, accumulate_grad_batches=2)
    assert_same_weights(reference, piped)


@pytest.mark.parametrize("schedule", ["pipedream_2bw", "pipedream"])
def test_async_schedules_with_replicas_equal_one_pipeline_on_the_global_batch(schedule: str) -> None:
    """PipeDream's and PipeDream-2BW's delayed updates with 2 replicas are those of one pipeline on
    the doubled batch."""
    torch.manual_seed(0)
    one, two = twins(TinyNet())
    fit_pipeline(one, 2, data=loader(batch_size=24), schedule=schedule, chunks=3)
    fit_pipeline(two, 4, data=loader(batch_size=12), stages=2, schedule=schedule, chunks=3)
    assert_same_weights(one, two)


def test_shuffled_data_is_split_between_the_replicas_and_reshuffled_each_epoch(tmp_path) -> None:
    class Seen(L.Callback):
        def __init__(self) -> None:
            self.batches: list[list[float]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            self.batches.append(batch[0][:, 0].tolist())

        def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
            (tmp_path / f"seen{trainer.global_rank}.json").write_text(json.dumps(self.batches))

    data = torch.utils.data.DataLoader(loader().dataset, batch_size=8, shuffle=True)
    fit_pipeline(TinyNet(), 4, data=data, stages=2, chunks=2, max_steps=8, callbacks=[Seen()])
    seen = [json.loads((tmp_path / f"seen{r}.json").read_text()) for r in range(4)]
    assert seen[0] == seen[2] and seen[1] == seen[3]  # the stages of one replica read the same batches
    epoch = [[i for batch in seen[r][:4] for i in batch] for r in (0, 1)]  # 4 steps of 8 = one epoch of 32 per replica
    assert sorted(epoch[0] + epoch[1]) == sorted(loader().dataset.tensors[0][:, 0].tolist())  # disjoint, complete
    assert [i for batch in seen[0][4:] for i in batch] != epoch[0]  # the next epoch is shuffled anew


class _SmallBuckets(L.Callback):
    """Buckets of about one layer, and a record of when each step sent them."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        gradients = trainer.strategy.pipeline.gradients
        gradients.close()
        gradients.bucket_bytes = 200
        gradients.overlap(list(pl_module.parameters()))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        history = trainer.strategy.pipeline.gradients.reducer.history
        (Path(self.folder) / f"buckets{trainer.global_rank}.json").write_text(json.dumps(history))


@pytest.mark.parametrize("fusion", [True, False])
def test_buckets_are_sent_while_the_backward_runs(tmp_path, fusion: bool) -> None:
    """From the second step on, every bucket's all-reduce starts inside the backward (with and
    without gradient-accumulation fusion); the weights still equal plain training's."""
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference, loader(batch_size=24))
    fit_pipeline(
        piped, 4, data=loader(batch_size=12), stages=2, schedule="1f1b", chunks=3,
        gradient_accumulation_fusion=fusion, callbacks=[_SmallBuckets(str(tmp_path))],
    )  # fmt: skip
    assert_same_weights(reference, piped)
    for rank in range(4):
        history = json.loads((tmp_path / f"buckets{rank}.json").read_text())
        assert len(history) == 6 and history[0][0] == 0  # the first step counts the accumulations
        assert all(early == total and total >= 2 for early, total in history[1:]), (rank, history)


def _changing_batches() -> torch.utils.data.DataLoader:
    """Batches of changing sizes, as a sampler with a token budget gives, starting with a short one:
    2, 3, 3, 3, 3, 1, 3 micro-batches under chunks=3. A batch sampler of the user's own is read whole
    by every replica."""
    sizes, start, batches = [2, 12, 12, 5, 12, 1, 12], 0, []
    for size in sizes:
        batches.append(list(range(start, start + size)))
        start += size
    return torch.utils.data.DataLoader(loader().dataset, batch_sampler=batches)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble", "interleaved_1f1b"])
def test_replicas_train_with_changing_micro_batch_counts(tmp_path, schedule: str) -> None:
    """A short first batch, then full and short ones: each step expects its own number of gradient
    accumulations; the weights equal plain training's, and from the second step on every bucket's
    all-reduce starts inside the backward (schedules that average after the backward have no buckets)."""
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference, _changing_batches(), max_steps=7)
    overlapped = schedule in ("gpipe", "1f1b", "interleaved_1f1b")
    fit_pipeline(
        piped, 4, data=_changing_batches(), stages=2, schedule=schedule, chunks=3, max_steps=7,
        callbacks=[_SmallBuckets(str(tmp_path))] if overlapped else [],
    )  # fmt: skip
    assert_same_weights(reference, piped)
    for rank in range(4 if overlapped else 0):
        history = json.loads((tmp_path / f"buckets{rank}.json").read_text())
        assert len(history) == 7 and history[0][0] == 0
        assert all(early == total and total >= 2 for early, total in history[1:]), (rank, history)


@pytest.mark.parametrize(
    "schedule, stages",
    [
        ("gpipe", 2),
        ("1f1b", 2),
        ("1f1b", 1),
        ("zero_bubble", 2),
        ("interleaved_1f1b", 2),
        ("interleaved_zero_bubble", 2),
    ],
)
def test_sharded_replicas_train_as_plain_training_on_the_global_batch(schedule: str, stages: int) -> None:
    reference, piped = _twins_fit(
        TinyNet, loader, 12, 4 // stages, 4, stages=stages, schedule=schedule, chunks=3, data_parallel="shard"
    )
    assert_same_weights(reference, piped)


def test_sharded_replicas_shard_the_parameters_outside_the_sequential_and_train_as_plain() -> None:
    """An input projection before the split Sequential and a head after it, sharded with their stages'
    layers over the same replicas (the stage that does not use one never gathers it)."""
    reference, piped = _twins_fit(WrappedNet, loader, 12, 2, 4, stages=2, chunks=3, data_parallel="shard")
    assert_same_weights(reference, piped)


def test_sharded_replicas_sum_a_weight_tied_across_stages_shard_by_shard() -> None:
    """The first and last layer share a weight; each stage shards its copy over its replicas (the same
    rows on replica r of both), and the tie's gradients are summed over those shards."""
    reference, piped = _twins_fit(TiedNet, token_loader, 12, 2, 4, stages=2, chunks=3, data_parallel="shard")
    assert_same_weights(reference, piped)


class _ShardRecord(L.Callback):
    """Per optimizer step: bytes this rank reduce-scatters or all-reduces over its stage's replicas;
    at the end: its optimizer state's elements and its stage's parameter elements (whole)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.steps: list[int] = []
        self.current = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import torch.distributed as dist

        group = trainer.strategy.pipeline.topology.dp_group
        record = self

        def counting(original, position: int):  # type: ignore[no-untyped-def]
            def collective(*args, **kwargs):  # type: ignore[no-untyped-def]
                if kwargs.get("group") is group:
                    tensor = kwargs["input"] if "input" in kwargs else args[position]
                    if tensor.dtype == torch.float32:
                        record.current += tensor.numel() * tensor.element_size()
                return original(*args, **kwargs)

            return collective

        dist.all_reduce = counting(dist.all_reduce, 0)  # this process is a fork that ends with the fit
        dist.reduce_scatter_single = counting(dist.reduce_scatter_single, 1)  # FSDP2's reduce-scatter

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.steps.append(self.current)
        self.current = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_pipe.runtime.replicas.sharding import local

        optimizer = trainer.optimizers[0]
        state = sum(
            local(v).numel() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
        )
        params = sum(p.numel() for p in pl_module.parameters())  # a DTensor's numel is the whole tensor's
        record = {"steps": self.steps, "state": state, "params": params, "bytes": params * 4}
        (Path(self.folder) / f"shard{trainer.global_rank}.json").write_text(json.dumps(record))


def test_sharded_stage_reduces_once_per_step_and_holds_a_share_of_the_optimizer_state(tmp_path) -> None:
    torch.manual_seed(0)
    model = TinyNet(depth=8)
    fit_pipeline(
        model, 4, stages=2, chunks=4, max_steps=3, data_parallel="shard", callbacks=[_ShardRecord(str(tmp_path))]
    )
    records = [json.loads((tmp_path / f"shard{rank}.json").read_text()) for rank in range(4)]
    for stage in range(2):
        pair = records[2 * stage : 2 * stage + 2]  # the stage's two replicas
        # SGD momentum: one buffer per parameter, split between the replicas (by rows: about half each)
        assert sum(r["state"] for r in pair) == pair[0]["params"], pair
        assert all(abs(r["state"] - r["params"] / 2) <= 8 for r in pair), pair
    for rank, record in enumerate(records):
        # one reduction of the stage's gradients per step, not one per micro-batch (4 here)
        assert all(record["bytes"] <= b <= 1.2 * record["bytes"] for b in record["steps"]), (rank, record)


def test_sharded_replicas_clip_by_the_global_norm() -> None:
    reference, piped = _twins_fit(
        TinyNet, loader, 12, 2, 4, stages=2, chunks=3, data_parallel="shard", gradient_clip_val=0.05
    )
    assert_same_weights(reference, piped)


@pytest.mark.parametrize(
    "model, options, message",
    [
        (TinyNet, {"schedule": "pipedream_2bw"}, "keeps weight versions"),
    ],
    ids=["async"],
)
def test_shard_refuses_what_it_cannot_run_before_training(model, options: dict, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(Exception, match=message):
        fit_pipeline(model(), 4, stages=2, chunks=3, data_parallel="shard", **options)
