"""The training DataLoader as the pipeline reads it, and its position in a checkpoint.

A DataLoader the pipeline steers (see :mod:`lightning_pipe.trainer.dataloaders.replica_data`) gets a
:class:`~lightning_pipe.trainer.dataloaders.replica_data.ReplicaOrder` for this replica. Every training
DataLoader gets Lightning's loader state (``state_dict`` / ``load_state_dict``): Lightning keeps it
in the checkpoint's loop state and hands it back before the resumed epoch's first batch, where it
resumes (Lightning restores it when it restarts in an epoch, and under ``max_steps`` at an epoch's
end too). The position saved is the global samples of the epoch that Lightning's loop counts as
trained (its processed batches x the batch x the replicas): a batch the DataLoader had fetched
ahead is read again after the resume, as in an uninterrupted run. Where the pipeline cannot steer
the DataLoader, a resume that is not exact says so once, on rank 0.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from lightning_pipe.trainer import internals
from lightning_pipe.trainer.dataloaders.replica_data import ReplicaOrder, not_steered
from lightning_pipe.trainer.dataloaders.sampling import is_deterministic

EXACT = (
    "A resume is exact for a map-style dataset read with shuffle=True or False (a RandomSampler or a "
    "SequentialSampler) and the default batch sampler (docs/training.md#checkpoints)."
)


def training_loader(
    dataloader: DataLoader,
    trainer: Any,
    num_replicas: int,
    replica: int,
    mode: Any = None,
    resumed: Callable[[bool], None] | None = None,
) -> Any:
    """``dataloader`` as this replica reads it in training, with its position kept in checkpoints;
    ``resumed`` is told whether the run continues within an epoch, before its first iterator."""
    why = not_steered(dataloader)
    order = None
    if why is None:
        sampler = dataloader.sampler
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # seed_everything's, as Lightning seeds DistributedSampler
        shuffle = isinstance(sampler, RandomSampler)
        order = ReplicaOrder(dataloader.dataset, num_replicas, replica, shuffle, seed, sampler)
        if trainer is not None:  # the epoch Lightning sets next: a DataLoader with workers draws before it does
            order.set_epoch(trainer.fit_loop.epoch_progress.current.processed)
        dataloader = internals.update_dataloader(dataloader, order, mode=mode)
    if trainer is not None and trainer.fit_loop.is_resuming:
        _say_what_is_not_exact(trainer, dataloader, why)
    if trainer is not None and resumed is not None:
        progress = trainer.fit_loop.epoch_loop.batch_progress
        resumed(progress.current.processed > 0 and not progress.is_last_batch)
    batch = dataloader.batch_size or 1
    keep_position(dataloader, order, (lambda: _trained(trainer)) if trainer is not None else None, batch * num_replicas)
    return dataloader


def give_saved_position(trainer: Any, resumed: Callable[[bool], None] | None = None) -> bool:
    """After the checkpoint's loop state is restored, before the first batch: training loaders built before
    the restore get the saved position now (Lightning hands a position only to loaders it builds after the
    restore, and ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` builds them before it);
    ``resumed`` is told again whether the run continues within an epoch. Whether there was one to give."""
    # Lightning loads a state only into a restarting loop (mid-epoch); at an epoch's end it keeps it unread, and
    # making the iterator again there would draw its seed twice from the random state dropout draws from
    restarting = bool(trainer.fit_loop.restarting)
    if not (restarting and internals.training_loaders_built(trainer) and internals.pending_loader_states(trainer)):
        return False
    progress = trainer.fit_loop.epoch_loop.batch_progress
    if resumed is not None:  # a save at an epoch's end restores the random state before the iterator draws
        resumed(progress.current.processed > 0 and not progress.is_last_batch)
    internals.load_training_loader_states(trainer)
    return True


def regroup_orders(loaders: Any, replicas: int, accumulate: int) -> None:
    """Have every training loader in ``loaders`` (the Trainer's: one, or a list or dict of them) that the
    pipeline steers read each update as ``replicas`` replicas did (see :meth:`ReplicaOrder.regroup`)."""
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        for loader in loaders:
            regroup_orders(loader, replicas, accumulate)
        return
    if not isinstance(loaders, DataLoader):
        return
    sampler = getattr(loaders.batch_sampler, "sampler", None) if loaders.batch_sampler is not None else loaders.sampler
    if isinstance(sampler, ReplicaOrder):
        sampler.regroup(replicas, accumulate, loaders.batch_size or 1)


def _trained(trainer: Any) -> tuple[int, bool]:
    """The batches of the running epoch that Lightning's loop counts as trained, and whether it ended."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.current.processed, bool(progress.is_last_batch)


def keep_position(
    dataloader: DataLoader,
    order: ReplicaOrder | None,
    trained: Callable[[], tuple[int, bool]] | None,
    global_batch: int,
) -> None:
    """Give ``dataloader`` Lightning's loader state: ``order``'s position after the batches of
    ``global_batch`` samples that ``trained()`` counts (and whether the epoch ended); nothing without an
    order (a resume then starts the epoch again). Attributes of this instance: the class is the user's."""

    def state_dict() -> dict[str, Any]:
        if order is None or trained is None:
            return {}
        batches, ended = trained()
        return order.position(batches * global_batch, ended)

    def load_state_dict(state: dict[str, Any]) -> None:
        if order is None or not state:
            return
        problem = order.resume(state)
        if problem is not None:
            rank_zero_warn(f"lightning-pipe: resuming: {problem}. {EXACT}")

    object.__setattr__(dataloader, "state_dict", state_dict)
    object.__setattr__(dataloader, "load_state_dict", load_state_dict)


def _say_what_is_not_exact(trainer: Any, dataloader: DataLoader, why: str | None) -> None:
    """Once per resume, on rank 0: what the resumed run reads that an uninterrupted one would not."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    done, epoch = progress.current.processed, trainer.fit_loop.epoch_progress.current.processed
    mid_epoch = done > 0 and not progress.is_last_batch
    if why is None:
        if mid_epoch and not internals.pending_loader_states(trainer):
            rank_zero_warn(
                f"lightning-pipe: resuming after {done} batches of epoch {epoch} from a checkpoint that holds no "
                "position of the training data (written by plain Lightning or an earlier lightning-pipe): the epoch "
                "starts again from its first batch, so the resumed run reads other batches than an uninterrupted one."
            )
        return
    sampler = dataloader.batch_sampler if dataloader.batch_sampler is not None else dataloader.sampler
    drawn = not isinstance(dataloader.dataset, IterableDataset) and not is_deterministic(sampler)
    if not (mid_epoch or drawn):
        return
    what = []
    if mid_epoch:
        what.append(f"the checkpoint was saved after {done} batches of epoch {epoch}, and Lightning starts that epoch "
                    "again from its first batch")  # fmt: skip
    if drawn:
        what.append("its sampler draws from the process's random state")
    rank_zero_warn(
        f"lightning-pipe: resuming with a training DataLoader the pipeline does not steer ({why}): "
        f"{'; '.join(what)}, so the resumed run reads other batches than an uninterrupted one. {EXACT}"
    )
