"""Regression tests for faults found by probing the strategy as a user would: samplers that drift
apart between stages, NaN losses, 2BW on a short batch, batch shapes that differ between ranks, a
0-sample batch, and a crash while a checkpoint is written."""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler

from lightning_pipe import PipelineStrategy
from lightning_pipe import checkpoint as ckpt_files
from lightning_pipe.checkpoint import consolidate, read
from tests.models import HIDDEN, IN, MaskedNet, TinyNet, dataset, fit_plain, loader
from tests.pipeline import assert_same_weights, fit_pipeline
from tests.runtime.test_async_pipeline import _cycle, _reference, _stage_delays

pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------------------- samplers
class RecordingDataset(Dataset):
    """The tests' dataset, writing the indices this process fetched to ``<folder>/indices<rank>.json``."""

    def __init__(self, folder: str, n: int = 64) -> None:
        self.data = dataset(n)
        self.folder = folder
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        self.fetched.append(int(index))
        rank = dist.get_rank() if dist.is_initialized() else 0
        Path(self.folder, f"indices{rank}.json").write_text(json.dumps(self.fetched))
        return self.data[index]


class DrawsRandomNumbers(nn.Module):
    """Consumes the process's random state like dropout does, without changing the values, so that
    the weights can be compared with plain training while the stages' random states drift apart."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.0 * torch.rand_like(x) if self.training else x


def test_every_stage_trains_on_the_first_stages_samples_whatever_the_sampler(tmp_path: Path) -> None:
    torch.manual_seed(0)
    piped = TinyNet()
    piped.layers.insert(1, DrawsRandomNumbers())  # on stage 0 only: its random state runs ahead
    reference = TinyNet()
    reference.layers.insert(1, DrawsRandomNumbers())
    reference.load_state_dict(piped.state_dict())
    data = RecordingDataset(str(tmp_path))
    sampler = WeightedRandomSampler(torch.ones(len(data)), len(data))
    fit_pipeline(piped, 2, DataLoader(data, batch_size=16, sampler=sampler), chunks=3, max_steps=12)  # 3 epochs

    drawn = [json.loads((tmp_path / f"indices{rank}.json").read_text()) for rank in range(2)]
    assert len(drawn[0]) == 12 * 16
    assert drawn[0] == drawn[1]  # the last stage's labels belong to the first stage's inputs
    assert drawn[0][:64] != drawn[0][64:128]  # the sampler did draw new orders
    replay = DataLoader(dataset(), batch_sampler=[drawn[0][i : i + 16] for i in range(0, len(drawn[0]), 16)])
    fit_plain(reference, replay, max_steps=12)
    assert_same_weights(reference, piped)


def test_dropout_with_a_custom_sampler_gives_every_stage_the_same_indices(tmp_path: Path) -> None:
    class Shuffled(torch.utils.data.Sampler):
        """A custom sampler on Python's random state."""

        def __iter__(self):
            import random

            order = list(range(64))
            random.shuffle(order)
            return iter(order)

        def __len__(self) -> int:
            return 64

    torch.manual_seed(0)
    data = RecordingDataset(str(tmp_path))
    fit_pipeline(TinyNet(dropout=0.5), 2, DataLoader(data, batch_size=16, sampler=Shuffled()), chunks=2, max_steps=8)
    drawn = [json.loads((tmp_path / f"indices{rank}.json").read_text()) for rank in range(2)]
    assert drawn[0] == drawn[1] and len(drawn[0]) == 8 * 16


# ---------------------------------------------------------------------------- NaN losses
class NaNAtSecondBatch(TinyNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 1 else loss


class RecordLosses(L.Callback):
    """Each rank's reported loss per step and final ``train_loss`` metric, to ``<folder>/losses<rank>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder, self.losses = folder, []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        final = float(trainer.callback_metrics["train_loss"])
        Path(self.folder, f"losses{trainer.global_rank}.json").write_text(
            json.dumps({"steps": self.losses, "final": final})
        )


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-4) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream_2bw"])
def test_a_nan_loss_trains_on_and_is_reported_alike_on_every_rank(tmp_path: Path, schedule: str) -> None:
    torch.manual_seed(0)
    piped = NaNAtSecondBatch()
    reference = NaNAtSecondBatch()
    reference.load_state_dict(piped.state_dict())
    plain = RecordLosses(str(tmp_path / "plain"))
    (tmp_path / "plain").mkdir()
    fit_plain(reference, max_steps=4, callbacks=[plain])
    fit_pipeline(piped, 2, schedule=schedule, chunks=3, max_steps=4, callbacks=[RecordLosses(str(tmp_path))])
    reports = [json.loads((tmp_path / f"losses{rank}.json").read_text()) for rank in range(2)]
    expected = json.loads((tmp_path / "plain" / "losses0.json").read_text())
    assert math.isnan(expected["final"])
    for report in reports:
        assert math.isnan(report["final"])  # every rank reports what plain training reports
        if schedule != "pipedream_2bw":  # (2BW shares a step's values with the other ranks a step late)
            assert _same(report["steps"], expected["steps"]), (report, expected)
    for model in (reference, piped):  # the NaN reached every weight on every stage, as without the pipeline
        assert all(torch.isnan(p).all() for p in model.parameters())


# ---------------------------------------------------------------------------- 2BW on a short batch
def test_2bw_runs_an_epochs_short_last_batch_by_its_update_rule() -> None:
    torch.manual_seed(0)
    piped = TinyNet(lr=0.1)
    piped.optimizer = "plain-sgd"
    reference = TinyNet()
    reference.load_state_dict(piped.state_dict())
    data = loader(n=66, batch_size=16)  # the epoch's fifth batch holds 2 samples: 2 micro-batches < stages - 1
    steps = 7
    batches = [b for _, b in zip(range(steps), _cycle(data))]
    assert len(batches[4][0]) == 2
    _reference(reference, batches, 0.1, _stage_delays("pipedream_2bw", 4, 8, reference))
    fit_pipeline(piped, 4, data, schedule="pipedream_2bw", chunks=8, max_steps=steps)
    assert_same_weights(reference, piped, rtol=1e-4, atol=1e-6)


def test_2bw_with_too_few_chunks_fails_before_training(tmp_path: Path) -> None:
    class Trains(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            Path(tmp_path, "trained").touch()

    with pytest.raises(Exception, match=r"chunks >= stages - 1; got chunks=2 with 4 stages. Use chunks >= 3"):
        fit_pipeline(TinyNet(), 4, schedule="pipedream_2bw", chunks=2, callbacks=[Trains()])
    assert not (tmp_path / "trained").exists()


# ---------------------------------------------------------------------------- shapes differ between ranks
def _rank_dependent_loader() -> DataLoader:
    """Pads the second batch by a per-process amount, as a collate_fn on the process's random state would."""
    from tests.models import CLASSES

    g = torch.Generator().manual_seed(3)
    items = [(torch.randn(4, IN, generator=g), int(torch.randint(0, CLASSES, (), generator=g))) for _ in range(32)]
    calls = []

    def collate(batch: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        calls.append(1)
        extra = dist.get_rank() if len(calls) % 4 == 2 else 0
        x = torch.zeros(len(batch), 4 + extra, IN)
        mask = torch.zeros(len(batch), 4 + extra, dtype=torch.bool)
        for i, (seq, _) in enumerate(batch):
            x[i, :4], mask[i, :4] = seq, True
        return x, mask, torch.tensor([label for _, label in batch])

    return DataLoader(items, batch_size=8, collate_fn=collate)


class Project(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(IN, HIDDEN)

    def forward(self, inputs: Any) -> Any:
        x, mask = inputs
        return self.linear(x), mask


class MaskedSequence(MaskedNet):
    """MaskedNet with its input projection inside the Sequential (as the asynchronous schedules need)."""

    def __init__(self) -> None:
        super().__init__()
        del self.proj
        self.layers.insert(0, Project())

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.layers((x, mask))


@pytest.mark.parametrize("schedule, stages", [("1f1b", 2), ("gpipe", 4), ("pipedream_2bw", 2)])
def test_batch_shapes_that_differ_between_ranks_stop_with_an_error_naming_them(schedule: str, stages: int) -> None:
    start = time.monotonic()
    with pytest.raises(
        Exception,
        match=r"stages loaded batches of different shapes for the same step \(stage 0: .*shapes \[\(3, 4, 6\)",
    ):
        fit_pipeline(MaskedSequence(), stages, _rank_dependent_loader(), schedule=schedule, chunks=3, max_steps=4)
    assert time.monotonic() - start < 120  # a deadline against a hang (the 30-minute timeout), not a speed


# ---------------------------------------------------------------------------- a 0-sample batch
def _with_an_empty_batch() -> DataLoader:
    def collate(batch: list) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.stack([x for x, _ in batch])
        y = torch.stack([y for _, y in batch])
        if x.shape[0] == 12 and float(x[0, 0]) == float(dataset()[12][0][0]):  # the second batch: filtered out
            return x[:0], y[:0]
        return x, y

    return DataLoader(dataset(), batch_size=12, collate_fn=collate)


def test_an_empty_batch_runs_as_in_plain_lightning(tmp_path: Path) -> None:
    torch.manual_seed(0)
    piped = TinyNet()
    reference = TinyNet()
    reference.load_state_dict(piped.state_dict())
    (tmp_path / "plain").mkdir()
    fit_plain(reference, _with_an_empty_batch(), max_steps=4, callbacks=[RecordLosses(str(tmp_path / "plain"))])
    fit_pipeline(piped, 2, _with_an_empty_batch(), chunks=3, max_steps=4, callbacks=[RecordLosses(str(tmp_path))])
    expected = json.loads((tmp_path / "plain" / "losses0.json").read_text())["steps"]
    assert math.isnan(expected[1]) and not math.isnan(expected[2])
    for rank in range(2):
        assert _same(json.loads((tmp_path / f"losses{rank}.json").read_text())["steps"], expected)
    assert_same_weights(reference, piped)


# ---------------------------------------------------------------------------- checkpoints
def _fail_on_rank1_at_step(step: int):
    original = ckpt_files.write_shard

    def write_shard(path: Any, rank: int, *args: Any, **kwargs: Any) -> None:
        tag = kwargs.get("tag") if "tag" in kwargs else args[3] if len(args) > 3 else None
        if rank == 1 and tag is not None and tag["global_step"] == step:
            Path(path, ckpt_files.shard_name(rank)).write_bytes(b"half a shard")
            raise OSError("disk full (injected)")
        original(path, rank, *args, **kwargs)

    return write_shard


def test_a_crash_while_saving_leaves_the_previous_last_checkpoint_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_pipe.checkpoint import stage_io

    monkeypatch.setattr(stage_io, "write_shard", _fail_on_rank1_at_step(4))  # the forked ranks inherit it
    torch.manual_seed(0)
    piped = TinyNet()
    initial = {k: v.clone() for k, v in piped.state_dict().items()}
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=2)
    with pytest.raises(Exception, match="disk full"):
        fit_pipeline(piped, 2, chunks=3, max_steps=6, enable_checkpointing=True, callbacks=[saves])
    last = read(tmp_path / "last.ckpt")[0]
    assert last["global_step"] == 2  # the save of step 2, whole
    reference = TinyNet()
    reference.load_state_dict(initial)
    fit_plain(reference, max_steps=2)
    restored = TinyNet()
    restored.load_state_dict(consolidate(tmp_path / "last.ckpt")["state_dict"])
    assert_same_weights(reference, restored)


def test_damaged_checkpoints_are_refused_naming_the_file(tmp_path: Path) -> None:
    saves = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2, filename="{step}")
    fit_pipeline(TinyNet(), 2, chunks=3, max_steps=4, enable_checkpointing=True, callbacks=[saves])
    early, late = tmp_path / "step=2.ckpt", tmp_path / "step=4.ckpt"
    read(late)  # whole
    shard = ckpt_files.shard_name(1)
    (late / shard).write_bytes((early / shard).read_bytes())  # a shard of another save
    with pytest.raises(
        RuntimeError,
        match=r"stage-00001.pt belongs to the save of step 2 \(epoch 0\), but .*meta.pt to the save of step 4",
    ):
        read(late)
    (late / shard).write_bytes((early / shard).read_bytes()[:100])  # truncated
    with pytest.raises(RuntimeError, match=r"stage-00001.pt cannot be read .*damaged or truncated"):
        read(late)
    (late / shard).unlink()
    with pytest.raises(FileNotFoundError, match=r"stage-00001.pt is missing"):
        read(late)


# ---------------------------------------------------------------------------- per-process random data
class NoisyDataset(Dataset):
    """Draws each sample from the process's random state: the stages see different samples."""

    def __len__(self) -> int:
        return 48

    def __init__(self) -> None:
        self.generator: Any = None

    def __getitem__(self, index: int) -> Any:
        if self.generator is None:  # separate processes start from different random states
            self.generator = torch.Generator().manual_seed(os.getpid())
        return torch.randn(IN, generator=self.generator), int(index % 3)


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream_2bw"])
def test_per_process_random_samples_stop_at_the_first_step_naming_the_loader(schedule: str) -> None:
    start = time.monotonic()
    with pytest.raises(
        Exception,
        match=r"loaded different data for the same step from the training DataLoader \(dataset "
        r"NoisyDataset\).*manual_seed\(index\)",
    ):
        fit_pipeline(
            TinyNet(dropout=0.5), 2, DataLoader(NoisyDataset(), batch_size=8), schedule=schedule, chunks=2, max_steps=4
        )
    assert time.monotonic() - start < 120  # a deadline against a hang (the 30-minute timeout), not a speed


def test_check_data_every_n_steps_catches_data_that_drifts_later(tmp_path: Path) -> None:
    class LateDrift(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, index: int) -> Any:
            x, y = dataset()[index]
            return (x + os.getpid() if index >= 40 else x), y  # the 6th batch on differs per process

    with pytest.raises(
        Exception,
        match=r"different data for the same step from the training DataLoader \(dataset LateDrift\) at batch 6 of "
        r"epoch 0 \(global step 6\), compared every 2 batches, so they may differ from batch 5 on",
    ):
        fit_pipeline(TinyNet(), 2, DataLoader(LateDrift(), batch_size=8), check_data=2, max_steps=8)
    with pytest.raises(Exception, match=r"\(dataset LateDrift\) at batch 5 of epoch 0 \(global step 5\):"):
        fit_pipeline(TinyNet(), 2, DataLoader(LateDrift(), batch_size=8), check_data=True, max_steps=8)
    fit_pipeline(TinyNet(), 2, DataLoader(LateDrift(), batch_size=8), check_data=False, max_steps=8)  # shapes only


def test_check_data_says_which_steps_compare_values() -> None:
    from lightning_pipe.trainer.steps import checks_values

    def checked(check_data: object) -> list[int]:
        every = PipelineStrategy(check_data=check_data).config.check_data  # checked as the strategy checks it
        return [i for i in range(7) if checks_values(every, i)]

    assert checked(True) == [0, 1, 2, 3, 4, 5, 6]  # every step, by default
    assert checked(PipelineStrategy().config.check_data) == checked(True)
    assert checked(3) == [0, 3, 6]
    assert checked(1) == checked(True)
    assert checked(False) == []


class GlobalRandomDataset(Dataset):
    """Draws each sample from the process's global random state, as ``torch.randn`` in a
    ``__getitem__`` does, and records what this rank loaded to ``<folder>/loaded<rank>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.loaded: list[list[float]] = []

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> Any:
        x, y = torch.randn(IN), int(torch.randint(0, 3, ()))
        self.loaded.append([*x.tolist(), y])
        Path(self.folder, f"loaded{dist.get_rank()}.json").write_text(json.dumps(self.loaded))
        return x, y


class RecordSteps(L.Callback):
    """Writes the global steps this rank finished to ``<folder>/steps<rank>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.done: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.done.append(trainer.global_step)
        Path(self.folder, f"steps{trainer.global_rank}.json").write_text(json.dumps(self.done))


def test_data_that_parts_after_the_first_batch_is_caught_at_the_first_step_it_differs(tmp_path: Path) -> None:
    """Both processes start from the same random state, so the first batch is the same on both; the
    Dropout on the first stage then draws and the last stage's does not, and from then on the
    batches differ. The default check stops the run at the first batch that differs, before any
    optimizer step on it."""
    torch.manual_seed(0)
    model = TinyNet()
    model.layers.insert(1, nn.Dropout(0.5))  # on stage 0 only
    data = DataLoader(GlobalRandomDataset(str(tmp_path)), batch_size=8, shuffle=False)
    with pytest.raises(
        Exception,
        match=r"different data for the same step from the training DataLoader \(dataset GlobalRandomDataset\) at batch "
        r"(\d+) of epoch 0 \(global step \1\):",
    ) as caught:
        fit_pipeline(model, 2, data, chunks=2, max_steps=6, callbacks=[RecordSteps(str(tmp_path))])
    named = int(re.search(r"at batch (\d+) of epoch 0", str(caught.value)).group(1))

    loaded = [json.loads((tmp_path / f"loaded{rank}.json").read_text()) for rank in range(2)]
    batches = [[rows[i : i + 8] for i in range(0, min(map(len, loaded)), 8)] for rows in loaded]
    first = next(b for b, (mine, theirs) in enumerate(zip(*batches)) if mine != theirs)
    assert first >= 1  # the first batch was equal: a check at each epoch's first step alone misses it
    assert named == first
    for rank in range(2):  # every step before it trained, none after
        assert json.loads((tmp_path / f"steps{rank}.json").read_text())[-1] == first


def test_detect_anomaly_names_the_micro_batch_and_the_stage() -> None:
    match = (
        r"FloatingPointError: training_step returned a loss of nan for micro-batch 0 of 3 \(batch 1, global step 1\) "
        r"on rank 1 \(stage 1 of 2\).*\n.*lightning-pipe: raised by forward of micro-batch 0 on stage 1 \(rank 1\)"
    )
    with pytest.raises(Exception, match=match):
        fit_pipeline(NaNAtSecondBatch(), 2, chunks=3, max_steps=4, detect_anomaly=True)
