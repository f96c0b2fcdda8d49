"""A resumed run reads the batches an uninterrupted one reads: in the middle of an epoch, with
``shuffle=True``, at an epoch's end (the resume under fewer replicas runs in tests/trainer/launch/test_restarts.py,
the command line's ``resume=`` in tests/test_cli.py).

The oracle is plain Lightning on one process, uninterrupted, reading the pipeline's documented order:
the dataset's indices permuted from the run's seed and the epoch (``DistributedSampler``'s permutation
over one replica)."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, WeightedRandomSampler

from lightning_pipe.checkpoint import consolidate
from lightning_pipe.trainer.dataloaders.replica_data import ReplicaOrder
from lightning_pipe.trainer.dataloaders.resume_data import training_loader
from tests.models import TinyNet, dataset, fit_plain
from tests.pipeline import assert_same_weights, fit_pipeline, twins


def shuffled(n: int = 64, batch_size: int = 12, workers: int = 0) -> DataLoader:
    return DataLoader(dataset(n), batch_size=batch_size, shuffle=True, num_workers=workers)


def pipeline_order(n: int = 64, batch_size: int = 12, seed: int = 0) -> DataLoader:
    """``shuffled`` as the pipeline reads it, for plain Lightning: each epoch's permutation of the run's seed."""
    data = dataset(n)
    order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=seed)
    return DataLoader(data, batch_size=batch_size, sampler=order)


# 64 samples in batches of 12: 6 batches per epoch (the last of 4)
STOPS = {
    "mid_epoch": ({"max_steps": 3}, {"max_steps": 9}),  # saved after 3 of epoch 0's 6 batches, resumed into epoch 1
    "epoch_end": ({"max_steps": -1, "max_epochs": 1}, {"max_steps": -1, "max_epochs": 2}),
    # a DataLoader with a worker draws its first batches before Lightning sets the epoch: saved in epoch 1,
    # or at the end of epoch 1 (the next epoch, 2, not 0, read first)
    "workers_mid_epoch": ({"max_steps": 9}, {"max_steps": 12}),
    "workers_epoch_end": ({"max_steps": -1, "max_epochs": 2}, {"max_steps": -1, "max_epochs": 3}),
}


@pytest.mark.parametrize("stop", sorted(STOPS))
def test_a_shuffled_run_resumed_trains_on_the_batches_of_an_uninterrupted_one(tmp_path: Path, stop: str) -> None:
    """Saved in the middle of an epoch (Lightning alone starts a plain DataLoader's epoch again), or at
    its end (the next epoch's order must not depend on the process's random state): the resumed weights
    equal those of plain training that was never stopped."""
    L.seed_everything(0)
    first, plain = twins(TinyNet())
    before, after = STOPS[stop]
    # every 3 steps (in on_train_batch_end), or at each epoch's end (in on_train_epoch_end: no loader state
    # comes back, as Lightning does not restart in an epoch)
    every = 3 if stop.endswith("mid_epoch") else None
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=every)
    data = shuffled(workers=1 if stop.startswith("workers") else 0)
    fit_pipeline(first, 2, data, chunks=2, callbacks=[saves], enable_checkpointing=True, **before)
    resumed = TinyNet()
    fit_pipeline(resumed, 2, data, chunks=2, ckpt_path=str(tmp_path / "last.ckpt"), **after)
    fit_plain(plain, pipeline_order(), **after)
    assert_same_weights(plain, resumed)
    assert not torch.equal(first.layers[0].weight, resumed.layers[0].weight)  # the resumed run trained on
    if stop != "mid_epoch":
        return
    # consolidated, the checkpoint leaves the pipeline's data position out: plain Lightning, which refuses a
    # loader state for its plain DataLoader, resumes it (starting the epoch again, as it warns)
    consolidate(tmp_path / "last.ckpt", tmp_path / "plain.ckpt")
    fit_plain(TinyNet(), shuffled(), ckpt_path=str(tmp_path / "plain.ckpt"), **after)


def _resumed_trainer(processed: int, last: bool, states: list) -> SimpleNamespace:
    """What the data hooks read of a Trainer that restored a checkpoint saved after ``processed`` batches."""
    batches = SimpleNamespace(current=SimpleNamespace(processed=processed), is_last_batch=last)
    fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=batches), is_resuming=True,
                               epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=0)),
                               _combined_loader_states_to_load=states)  # fmt: skip
    return SimpleNamespace(fit_loop=fit_loop)


def test_a_resume_the_pipeline_cannot_make_exact_says_so_once() -> None:
    """A sampler the pipeline does not steer, resumed in the middle of an epoch: Lightning starts the saved
    epoch again, and the sampler draws from the process's random state; the warning says both (and the
    loader is one Lightning counts as resumable, so that its generic warning does not come as well)."""
    data = dataset(64)
    weighted = DataLoader(data, batch_size=12, sampler=WeightedRandomSampler(torch.ones(64), 64))
    said = ("lightning-pipe: resuming with a training DataLoader the pipeline does not steer (a custom sampler "
            "(WeightedRandomSampler)): the checkpoint was saved after 3 batches of epoch 0, and Lightning starts that "
            "epoch again from its first batch; its sampler draws from the process's random state")  # fmt: skip
    with pytest.warns(UserWarning) as caught:
        loader = training_loader(weighted, _resumed_trainer(3, False, []), 1, 0)
    assert [str(w.message) for w in caught if said in str(w.message)] and len(caught) == 1
    assert isinstance(loader, _Stateful) and loader.state_dict() == {}
    sequential = DataLoader(data, batch_size=12)
    with pytest.warns(UserWarning, match="holds no position of the training data"):  # a plain Lightning checkpoint
        training_loader(sequential, _resumed_trainer(3, False, []), 1, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        steered = training_loader(sequential, _resumed_trainer(3, False, [{"samples": 36}]), 1, 0)
        training_loader(sequential, _resumed_trainer(6, True, []), 1, 0)  # at an epoch's end: nothing to say
    assert isinstance(steered.sampler, ReplicaOrder) and isinstance(steered, _Stateful)


class ValidatedNet(TinyNet):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))


class UnevenDropoutNet(ValidatedNet):
    """One dropout on the first of 2 stages (layer 1), two on the second (layers 5 and 6): the ranks draw
    unequally, so their random states differ after the first step and one rank's state is no other's."""

    def __init__(self) -> None:
        super().__init__(dropout=0.5)
        self.layers[6] = torch.nn.Sequential(self.layers[6], torch.nn.Dropout(0.5))


def test_dropout_resumed_in_an_epoch_or_at_its_end_draws_the_masks_of_an_uninterrupted_run(tmp_path: Path) -> None:
    """Each rank's random state travels in the checkpoint (Lightning saves none): 2 stages whose ranks draw
    unequally (one dropout on stage 0, two on stage 1), resumed after 3 of an epoch's 6 batches and at the end
    of the epoch (step 6, saved before the epoch's validation), end with the weights of the run that was never
    stopped, exactly (plain Lightning's resume draws other dropout masks, and so would a rank given another
    rank's state)."""
    L.seed_everything(0)
    uninterrupted = UnevenDropoutNet()
    saves = ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1, every_n_train_steps=3)
    val = DataLoader(dataset(24, seed=1), batch_size=12)
    fit = dict(chunks=2, max_steps=9, limit_val_batches=1)
    fit_pipeline(uninterrupted, 2, shuffled(), val, callbacks=[saves], enable_checkpointing=True, **fit)
    for step in (3, 6):
        L.seed_everything(0)  # the run's seed (it orders the data); the processes' state is the run's start's
        resumed = UnevenDropoutNet()
        fit_pipeline(resumed, 2, shuffled(), val, ckpt_path=str(tmp_path / f"step={step}.ckpt"), **fit)
        assert_same_weights(uninterrupted, resumed, rtol=0, atol=0)


def test_a_plain_lightning_checkpoint_resumes_under_the_pipeline_with_its_optimizer(tmp_path: Path) -> None:
    """Trained 2 epochs by plain Lightning, continued for a third on 2 stages: the weights by name, Adam's state
    by position in the plain model mapped to each stage's parameters; the result is 3 plain epochs'."""
    L.seed_everything(0)
    first, whole = twins(TinyNet(optimizer="adam", lr=0.01))
    data = DataLoader(dataset(48), batch_size=12)
    trainer = fit_plain(first, data, max_steps=-1, max_epochs=2)
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    resumed = TinyNet(optimizer="adam", lr=0.01)
    fit_pipeline(resumed, 2, data, chunks=2, ckpt_path=str(tmp_path / "plain.ckpt"), max_steps=-1, max_epochs=3)
    fit_plain(whole, data, max_steps=-1, max_epochs=3)
    assert_same_weights(whole, resumed)
    assert not torch.equal(first.layers[0].weight, resumed.layers[0].weight)  # the third epoch trained


class OneCycleNet(TinyNet):
    """Sizes its OneCycleLR by ``trainer.estimated_stepping_batches``, as Lightning documents: reading it
    makes Lightning build the training DataLoader before the checkpoint's loop state is restored."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        total = int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _assert_same_checkpoint(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["global_step"] == b["global_step"]
    torch.testing.assert_close(a["state_dict"], b["state_dict"], rtol=0, atol=0)
    torch.testing.assert_close(a["optimizer_states"], b["optimizer_states"], rtol=0, atol=0)
    assert a["lr_schedulers"] == b["lr_schedulers"]


@pytest.mark.parametrize(("step", "workers"), [(3, 0), (6, 0), (9, 1)], ids=["mid_epoch", "epoch_end", "workers"])
def test_a_schedule_sized_by_estimated_stepping_batches_resumes_exactly(
    tmp_path: Path, step: int, workers: int
) -> None:
    """Saved after 3 of the first epoch's 6 batches, at its end, or in the second epoch with a worker (which
    draws batches as its iterator is made), and resumed: the loader built while ``configure_optimizers`` reads
    ``estimated_stepping_batches`` (before the restore) still gets the saved position, so the resumed run
    reads on from there (not from the epoch's first batch) and ends with the uninterrupted run's weights,
    momentum buffers and schedule."""
    L.seed_everything(0)
    uninterrupted = OneCycleNet()
    initial = uninterrupted.state_dict()
    fit = dict(chunks=2, max_steps=-1, max_epochs=2, enable_checkpointing=True)  # 12 steps, sized from the data
    saves = ModelCheckpoint(dirpath=tmp_path / "a", filename="{step}", save_top_k=-1, every_n_train_steps=3)
    fit_pipeline(uninterrupted, 2, shuffled(workers=workers), callbacks=[saves], **fit)
    L.seed_everything(0)
    resumed = OneCycleNet()
    resumed.load_state_dict(initial)
    again = ModelCheckpoint(dirpath=tmp_path / "b", filename="{step}", save_top_k=-1, every_n_train_steps=3)
    resume = str(tmp_path / "a" / f"step={step}.ckpt")
    fit_pipeline(resumed, 2, shuffled(workers=workers), callbacks=[again], ckpt_path=resume, **fit)
    assert_same_weights(uninterrupted, resumed, rtol=0, atol=0)
    _assert_same_checkpoint(consolidate(tmp_path / "a" / "step=12.ckpt"), consolidate(tmp_path / "b" / "step=12.ckpt"))
