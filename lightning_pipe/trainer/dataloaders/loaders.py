"""The Trainer's data as the pipeline needs it: the run's first batch before Lightning sets the
loaders up (for profiling), each stage's DataLoader (the first stage's order, each replica's part,
by Lightning's own re-instantiation, resumable: :mod:`lightning_pipe.trainer.dataloaders.resume_data`), whether
an evaluation step is a replica's padding, and the optimizers as the Trainer makes them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sized
from typing import Any, cast

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.optim import Optimizer
from torch.utils.data import DataLoader, SequentialSampler

from lightning_pipe.runtime.topology import Layout
from lightning_pipe.trainer import internals
from lightning_pipe.trainer.dataloaders.replica_data import EvaluationShare, splittable
from lightning_pipe.trainer.dataloaders.resume_data import training_loader
from lightning_pipe.trainer.dataloaders.sampling import share_order


def first_batch(trainer: Any) -> Any:
    """One batch of the data the Trainer is about to run (training data when fitting), drawn from a
    fresh iterator of the user's DataLoader before Lightning sets it up. The caller restores the
    random state the draw consumes."""
    loops = {
        TrainerFn.FITTING: trainer.fit_loop,
        TrainerFn.VALIDATING: trainer.validate_loop,
        TrainerFn.TESTING: trainer.test_loop,
        TrainerFn.PREDICTING: trainer.predict_loop,
    }
    source = internals.data_source(loops[trainer.state.fn])
    assert source is not None, "the Trainer's loops hold their data source"
    loaders = source.dataloader()
    if isinstance(loaders, (Mapping, list, tuple)):
        loaders = CombinedLoader(loaders, "max_size_cycle" if trainer.state.fn == TrainerFn.FITTING else "sequential")
        iterator = iter(loaders)
        batch = next(iterator)[0]
    else:
        iterator = iter(loaders)
        batch = next(iterator)
    del iterator
    return batch


def configured_optimizers(module: Any) -> list[Optimizer]:
    """The optimizers the module's ``configure_optimizers`` makes, as the Trainer reads its return
    value (any of its forms), unwrapped from ``LightningOptimizer``."""
    optimizers = internals.configure_optimizers(module.configure_optimizers())
    return [getattr(o, "optimizer", o) for o in optimizers]


def split_over_replicas(dataloader: Any, num_replicas: int, replica: int, mode: Any = None) -> Any:
    """``dataloader`` rebuilt for this replica (Lightning's own re-instantiation, which keeps the
    user's DataLoader arguments): for evaluation (``mode``: Lightning's ``RunningStage``) with an
    :class:`EvaluationShare`, for training with the order of :func:`.resume_data.training_loader`; or
    unchanged."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    if mode is None or not mode.evaluating:
        return training_loader(dataloader, None, num_replicas, replica, mode)
    if not splittable(dataloader, num_replicas):
        return dataloader
    size, drop_last = dataloader.batch_size, dataloader.drop_last
    assert size is not None  # a plain BatchSampler has one
    dataset = cast(Sized, dataloader.dataset)  # splittable: a map-style dataset, so it has a length
    rebuilt = internals.update_dataloader(dataloader, SequentialSampler(dataset), mode=mode)
    share = EvaluationShare(len(dataset), size, drop_last, num_replicas, replica)
    # the DataLoader forbids setting its batch sampler after construction; its iterators only read it
    object.__setattr__(rebuilt, "batch_sampler", share)
    return rebuilt


def stage_dataloader(
    dataloader: Any,
    trainer: Any,
    layout: Layout,
    rank: int,
    topology: Any,
    resumed: Callable[[bool], None] | None = None,
) -> Any:
    """``dataloader`` as global ``rank`` of ``layout`` draws from it: every stage of a pipeline loads
    the batch itself, in the first stage's order (a sampler drawing from a process's random state
    would differ between them; see :mod:`lightning_pipe.trainer.dataloaders.sampling`, over ``topology``'s meta
    group), and with replicas each replica loads its own part of every step (predict runs every sample on every
    replica). Training reads the run's order from where a resumed checkpoint left off; ``resumed``
    is told whether the training loader continues within an epoch (see :mod:`.random_states`)."""
    replica, meta_group = layout.replica_of(rank), topology.meta_group if topology is not None else None
    if trainer is not None and not trainer.predicting and isinstance(dataloader, DataLoader):
        mode = trainer.state.stage
        if mode is None or not mode.evaluating:
            dataloader = training_loader(dataloader, trainer, layout.replicas, replica, mode, resumed)
        elif layout.replicas > 1:
            dataloader = split_over_replicas(dataloader, layout.replicas, replica, mode)
    ranks = layout.pipeline_ranks(replica)
    return share_order(dataloader, meta_group, ranks[0], ranks)


def is_padding(trainer: Any, batch_idx: int, dataloader_idx: int) -> bool:
    """Whether the running evaluation step is a padding step of this replica's
    :class:`EvaluationShare`. The loader comes from the running evaluation loop (the Trainer's
    ``val_dataloaders`` would still give ``fit``'s in a later ``validate``)."""
    loaders = internals.evaluation_loaders(trainer)
    share = getattr(loaders[dataloader_idx], "batch_sampler", None) if dataloader_idx < len(loaders) else None
    return isinstance(share, EvaluationShare) and share.is_padding(batch_idx)
