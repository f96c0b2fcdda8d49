"""Pipeline checkpoints: one shard per stage plus shared metadata, under the original names.

A checkpoint is a directory (Lightning's checkpoint path, such as ``epoch=1-step=12.ckpt``)::

    meta.pt              the Trainer's state: epoch, loops, callbacks, schedulers, hyper-parameters
    stage-00000.pt       stage 0's parameters and optimizer state, keyed by parameter name
    stage-00001.pt       ...

Every stage writes its own shard at once. Because everything is keyed by name
(``layers.7.weight``) and never by a stage's position, a checkpoint loads under any number of
stages: each rank reads the names it holds (tensors are memory-mapped, so a rank reads little of
the others' shards). :func:`consolidate` turns a checkpoint into the plain file the unsplit
LightningModule loads, without processes::

    python -m lightning_pipe.checkpoint epoch=1-step=12.ckpt model.ckpt

Per-stage files rather than ``torch.distributed.checkpoint`` where each tensor has exactly one
owner (one pipeline, or replicas holding equal copies: replica 0 writes): the sharding planner has
nothing to do there, and plain ``torch.load(weights_only=True)`` reads the shards with or without
a process group. A stage sharded over its replicas (FSDP2) writes its tensors through
``torch.distributed.checkpoint`` into ``stage-NNNNN.dcp`` (every replica its part), next to a
``stage-NNNNN.pt`` with the rest; :func:`read` gives the whole tensors either way, without a
process group.

Every file carries the save's tag, and every tensor (every file of a ``.dcp`` directory) a
checksum recorded when it was written, compared when it is read. The modules, one job each:
:mod:`~lightning_pipe.checkpoint.files` (the directory's files, written and read),
:mod:`~lightning_pipe.checkpoint.sharded` (a stage's ``torch.distributed.checkpoint`` parts),
:mod:`~lightning_pipe.checkpoint.checksums`, :mod:`~lightning_pipe.checkpoint.tags` (the save tag),
:mod:`~lightning_pipe.checkpoint.staging` (swapping a complete save in),
:mod:`~lightning_pipe.checkpoint.optimizer_state` (optimizer states by name, and back to positions),
:mod:`~lightning_pipe.checkpoint.merged` (one view over every stage's shard),
:mod:`~lightning_pipe.checkpoint.consolidate` and its command line
:mod:`~lightning_pipe.checkpoint.cli`; :mod:`~lightning_pipe.checkpoint.stage_io` is how the ranks
of a running pipeline save and load together.
"""

from lightning_pipe.checkpoint import checksums
from lightning_pipe.checkpoint.cli import main
from lightning_pipe.checkpoint.consolidate import consolidate
from lightning_pipe.checkpoint.files import (
    FORMAT,
    META,
    is_pipeline_checkpoint,
    not_a_checkpoint,
    read,
    read_state_dict,
    shard_name,
    write_meta,
    write_shard,
    write_sharded_stage,
)
from lightning_pipe.checkpoint.merged import merged_async_state, merged_optimizer_states, merged_state_dict
from lightning_pipe.checkpoint.optimizer_state import (
    merge_optimizer_states,
    merge_orders,
    optimizer_state_by_name,
    optimizer_state_by_position,
    parameter_names,
    tie_aliases,
)
from lightning_pipe.checkpoint.sharded import dcp_name
from lightning_pipe.checkpoint.staging import prepare_staging, publish, staging_path
from lightning_pipe.checkpoint.tags import save_tag

__all__ = [
    "FORMAT",
    "META",
    "checksums",
    "consolidate",
    "dcp_name",
    "is_pipeline_checkpoint",
    "main",
    "merge_optimizer_states",
    "merge_orders",
    "merged_async_state",
    "merged_optimizer_states",
    "merged_state_dict",
    "not_a_checkpoint",
    "optimizer_state_by_name",
    "optimizer_state_by_position",
    "parameter_names",
    "prepare_staging",
    "publish",
    "read",
    "read_state_dict",
    "save_tag",
    "shard_name",
    "staging_path",
    "tie_aliases",
    "write_meta",
    "write_shard",
    "write_sharded_stage",
]
