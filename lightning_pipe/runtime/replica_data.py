"""Each data-parallel replica of the pipeline reads its own part of every step.

The DataLoader's sampler is replaced by a ``DistributedSampler`` over the ``d`` replicas, as
Lightning does for DDP (shuffled when the user's sampler shuffled, seeded by ``seed_everything``'s
seed and reshuffled per epoch through ``set_epoch``, which Lightning's loops call). All stages of
one replica build the same sampler, so they read the same indices in the same order; a
``DistributedSampler`` draws from no process state, so the pipeline's shared sample order
(:mod:`lightning_pipe.runtime.sampling`) leaves it alone. The global batch is ``d`` times the
DataLoader's batch size.

Samplers other than the plain sequential and random ones are kept as given: every replica then
reads them whole (each pipeline keeps its own shared order), and the replicas do not split the data.

:func:`mean_over_replicas` averages a step's summary (loss and logged means) over the replicas, so
what Lightning sees is the mean over the global batch.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler


def replica_sampler(dataloader: DataLoader, num_replicas: int, replica: int) -> Optional[DistributedSampler]:
    """The ``DistributedSampler`` that replaces ``dataloader``'s sampler, or None where the
    DataLoader is left as it is (one replica, an iterable dataset, a custom sampler)."""
    if num_replicas == 1 or isinstance(dataloader.dataset, IterableDataset):
        return None
    sampler = dataloader.sampler
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return None
    if type(sampler) not in (SequentialSampler, RandomSampler):
        return None
    return DistributedSampler(
        dataloader.dataset,
        num_replicas=num_replicas,
        rank=replica,
        shuffle=isinstance(sampler, RandomSampler),
        seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
    )


def split_over_replicas(dataloader: Any, num_replicas: int, replica: int, mode: Any = None) -> Any:
    """``dataloader`` rebuilt with :func:`replica_sampler` (Lightning's own re-instantiation, which
    keeps the user's DataLoader arguments), or unchanged."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    sampler = replica_sampler(dataloader, num_replicas, replica)
    if sampler is None:
        return dataloader
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler, mode=mode)


def mean_over_replicas(summary: dict[str, Any], group: Any, device: torch.device) -> dict[str, Any]:
    """The step summary's loss and logged values averaged over the replicas in ``group`` (every
    replica's last stage, which computed them). Every replica logs the same names per step."""
    values = [summary["loss"] if summary["loss"] is not None else 0.0] + [value for _, value, _ in summary["logs"]]
    flat = torch.tensor(values, dtype=torch.float64, device=device)
    size = torch.tensor([float(len(values))], dtype=torch.float64, device=device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    if any(int(s.item()) != len(values) for s in sizes):
        raise RuntimeError(
            "The data-parallel replicas logged different values in one step (counts "
            f"{[int(s.item()) for s in sizes]}). Under data parallelism every replica must log the same names "
            "in each step."
        )
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    means = flat.tolist()
    loss = means[0] if summary["loss"] is not None else None
    logs = [(name, mean, kwargs) for (name, _, kwargs), mean in zip(summary["logs"], means[1:])]
    return {**summary, "loss": loss, "logs": logs}


__all__ = ["mean_over_replicas", "replica_sampler", "split_over_replicas"]
