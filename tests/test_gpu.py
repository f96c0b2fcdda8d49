"""On a GPU (skipped without CUDA): one stage under NCCL, and two stages sharing one GPU.

NCCL refuses two ranks on one GPU, so the two-stage runs use gloo, which sends the stages' tensors
through pinned host memory: the executor, the CUDA streams of DualPipeV's F&B units and the
staging are the GPU code paths these reach. Every run is compared with plain training on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_pipe import PipelineStrategy
from tests.models import TinyNet, fit_plain, loader, trainer_kwargs
from tests.pipeline import assert_same_weights, twins

pytestmark = pytest.mark.gpu


def _data() -> torch.utils.data.DataLoader:
    return loader(n=48, batch_size=12)


def _fit_on_one_gpu(model: L.LightningModule, processes: int, callbacks: list | None = None, **options: Any) -> None:
    """Fit with ``processes`` ranks all on ``cuda:0`` (gloo between them when there are several)."""
    extra: dict[str, Any] = {}
    if processes > 1:
        extra = dict(parallel_devices=[torch.device("cuda", 0)] * processes, process_group_backend="gloo")
    strategy = PipelineStrategy(start_method="spawn", **options, **extra)
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, callbacks=callbacks or [], **trainer_kwargs())
    trainer.fit(model, _data())


def _close(reference: torch.nn.Module, piped: torch.nn.Module) -> None:
    # the GPU's float32 kernels sum in another order than the CPU's
    assert_same_weights(reference, piped.cpu(), rtol=1e-4, atol=1e-5)


def test_one_stage_on_a_gpu_trains_as_plain_training() -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=8))
    fit_plain(reference, _data())
    _fit_on_one_gpu(piped, 1, schedule="1f1b", chunks=4)
    _close(reference, piped)


@pytest.mark.parametrize(
    "schedule, chunks, recompute",
    [("1f1b", 4, "never"), ("zbv", 4, "never"), ("dualpipev", 4, "never"), ("dualpipev", 8, "always")],
)
def test_two_stages_sharing_a_gpu_train_as_plain_training(schedule: str, chunks: int, recompute: str) -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=8))
    fit_plain(reference, _data())
    _fit_on_one_gpu(piped, 2, schedule=schedule, chunks=chunks, recompute=recompute)
    _close(reference, piped)


class _StreamsSeen(L.Callback):
    """Records the CUDA stream of every forward of this rank's layers and writes the distinct ones
    to ``folder/streams-<rank>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.seen: set[int] = set()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for layer in pl_module.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.register_forward_pre_hook(self._record)

    def _record(self, _: torch.nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
            self.seen.add(torch.cuda.current_stream(args[0].device).stream_id)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        Path(self.folder, f"streams-{trainer.global_rank}.json").write_text(json.dumps(sorted(self.seen)))


def test_dualpipevs_units_run_their_forwards_on_a_second_cuda_stream(tmp_path: Path) -> None:
    """An F&B unit's forward takes the stream its backward's micro-batch did not use, so every
    process runs forwards on two streams (plain runs use one)."""
    torch.manual_seed(0)
    _fit_on_one_gpu(TinyNet(depth=8), 2, [_StreamsSeen(str(tmp_path))], schedule="dualpipev", chunks=8)
    seen = [json.loads(Path(tmp_path, f"streams-{rank}.json").read_text()) for rank in range(2)]
    assert all(len(streams) == 2 for streams in seen), seen


def test_the_speed_probe_and_free_memory_read_the_gpu() -> None:
    from lightning_pipe.partition.solvers.speeds import free_bytes, probe_timings

    device = torch.device("cuda", 0)
    seconds = probe_timings(device, repeats=2)
    assert len(seconds) == 2 and all(0 < s < 10 for s in seconds)
    free = free_bytes(device)
    assert free is not None and 0 < free <= torch.cuda.get_device_properties(device).total_memory


@pytest.mark.parametrize("balance", ["time", "memory"])
def test_a_measured_balance_with_every_ranks_speed_and_memory_on_one_gpu(balance: str) -> None:
    """Both ranks probe the one GPU (their speed and free memory) before the split; training then
    equals plain training whatever split they chose."""
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=8))
    fit_plain(reference, _data())
    _fit_on_one_gpu(piped, 2, schedule="1f1b", chunks=4, balance=balance)
    _close(reference, piped)


class _Order(L.Callback):
    """Writes this rank's layout order and stage to ``folder/order-<rank>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = {"order": list(trainer.strategy.layout.order), "stage": trainer.strategy.stage}
        Path(self.folder, f"order-{trainer.global_rank}.json").write_text(json.dumps(record))


def test_ranks_placed_by_speed_on_one_gpu_train_as_plain(tmp_path: Path) -> None:
    """4 ranks sharing the GPU as 2 stages x 2 replicas, ranks 1 and 3 said to be slow: the placed
    layout's DeviceMesh (rows by stage, not by rank) on a CUDA device, and training equal to plain
    training on the global batch."""
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=8))
    fit_plain(reference, loader(n=48, batch_size=24))
    _fit_on_one_gpu(
        piped, 4, [_Order(str(tmp_path))], schedule="1f1b", chunks=3, stages=2, balance="time",
        rank_speeds=[1.0, 0.5, 1.0, 0.5],
    )  # fmt: skip
    records = [json.loads(Path(tmp_path, f"order-{rank}.json").read_text()) for rank in range(4)]
    assert {tuple(r["order"]) for r in records} <= {(0, 2, 1, 3), (1, 3, 0, 2)} and len({str(r) for r in records}) == 2
    _close(reference, piped)


def test_a_given_rank_order_on_one_gpu_trains_as_plain(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=8))
    fit_plain(reference, _data())
    _fit_on_one_gpu(piped, 2, [_Order(str(tmp_path))], schedule="zbv", chunks=4, rank_order=[1, 0])
    assert json.loads(Path(tmp_path, "order-0.json").read_text()) == {"order": [1, 0], "stage": 1}
    _close(reference, piped)


class _Plan(L.Callback):
    """Writes rank 0's planned candidate's per-rank free memory and rank order to ``folder/plan.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            best = trainer.strategy.plan_candidates[0]
            record = {"free": list(best.rank_free), "fits": best.fits, "speeds": list(best.rank_speeds)}
            Path(self.folder, "plan.json").write_text(json.dumps(record))


def test_plan_auto_bounds_each_rank_by_its_own_free_memory_on_one_gpu(tmp_path: Path) -> None:
    """``plan="auto"`` on two ranks sharing the GPU: every rank's free memory reaches the planner as
    a budget per rank, the chosen candidate fits it, and training equals plain training."""
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=8))
    fit_plain(reference, _data())
    _fit_on_one_gpu(piped, 2, [_Plan(str(tmp_path))], plan="auto")
    record = json.loads(Path(tmp_path, "plan.json").read_text())
    total = torch.cuda.get_device_properties(0).total_memory
    assert len(record["free"]) == 2 and all(0 < f <= total for f in record["free"]) and record["fits"]
    assert len(record["speeds"]) == 2
    _close(reference, piped)
