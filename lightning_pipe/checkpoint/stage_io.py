"""How the ranks of a pipeline write and read a checkpoint together: each rank its stage's part.

Saving goes to a staging directory that replaces the target only once every rank wrote its part,
so a crash while saving leaves the previous checkpoint whole. Reading gives a rank the values of
its own stage, by parameter name, from a checkpoint written under any number of stages (or a plain
Lightning checkpoint), so a run resumes under another layout.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_pipe.checkpoint.files import (
    is_pipeline_checkpoint,
    not_a_checkpoint,
    write_meta,
    write_shard,
    write_sharded_stage,
)
from lightning_pipe.checkpoint.files import read as read_checkpoint
from lightning_pipe.checkpoint.merged import (
    merged_async_state,
    merged_elastic_state,
    merged_optimizer_states,
    merged_state_dict,
)
from lightning_pipe.checkpoint.staging import prepare_staging, publish, staging_path
from lightning_pipe.checkpoint.tags import save_tag

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: marks a checkpoint whose optimizer states are a plain Lightning run's: by position in the unsplit model
PLAIN_OPTIMIZERS = "lightning_pipe_plain_optimizers"


@dataclass(frozen=True)
class Writer:
    """Where this rank stands when it writes: its stage, its replica, and the process group's
    broadcast (from global rank 0) and barrier."""

    stage: int
    num_stages: int
    replica: int
    is_global_zero: bool
    broadcast: Callable[[Any], Any]
    barrier: Callable[[], None]
    dp_group: ProcessGroup | None = None  # set when the replicas hold shards (``data_parallel="shard"``)
    skip: frozenset[str] = frozenset()  # names this rank holds that another rank writes (Chimera's copies)
    # optimizer-state names of tensors this rank writes under another of their names: a weight tied
    # to another stage, whose first name is that of a copy written elsewhere (Chimera)
    rename: Mapping[str, str] = field(default_factory=dict)
    # what each rank's saved random state belongs to: the layout a resume must share to restore it
    random_key: Any = None
    # the unsplit module's state-dict names in its own order (the metadata keeps it for consolidation)
    order: tuple[str, ...] = ()


def save(checkpoint: dict[str, Any], path: Path, writer: Writer, extra: dict[str, Any] | None = None) -> None:
    """Write ``checkpoint`` (this rank's view: its stage's state) to the directory ``path``: every
    stage's shard (from replica 0, or every replica's shards under ``shard``), and, from global
    rank 0, the metadata every stage shares; then publish it at once for all."""
    staged = prepare_staging(path) if writer.is_global_zero else staging_path(path)
    tag = save_tag(checkpoint, writer.broadcast(uuid.uuid4().hex))
    rest = dict(checkpoint)
    state_dict = rest.pop("state_dict", {})
    optimizer_states = rest.pop("optimizer_states", None)
    if writer.skip:
        state_dict = {k: v for k, v in state_dict.items() if k not in writer.skip}
        if optimizer_states is not None:
            optimizer_states = [_without(named, writer.skip, writer.rename) for named in optimizer_states]
    if writer.dp_group is not None:  # every replica writes its shards (torch.distributed.checkpoint)
        write_sharded_stage(
            staged, writer.stage, state_dict, optimizer_states, writer.dp_group, writer.replica == 0, extra, tag
        )
    elif writer.replica == 0:  # the replicas hold equal copies: one writes them
        write_shard(staged, writer.stage, state_dict, optimizer_states, extra, tag)
    if writer.is_global_zero:
        write_meta(staged, rest, writer.num_stages, tag, writer.order)
    writer.barrier()  # every shard is complete
    if writer.is_global_zero:
        publish(staged, path)
    writer.barrier()  # no rank reads the checkpoint before it is in place


def _without(named: dict[str, Any], skip: frozenset[str], rename: Mapping[str, str]) -> dict[str, Any]:
    """An optimizer's by-name state without the parameters in ``skip``; the states named in ``rename``
    are kept under their new name, as the copy of a tied weight (an alias of its first name, like a
    tied weight on a later stage of 1F1B: no group member, its state kept for a layout that resumes it)."""
    state = {rename.get(n, n): v for n, v in named["state"].items()}
    groups = [{**g, "params": [n for n in g["params"] if n not in skip]} for g in named["param_groups"]]
    out = {**named, "state": {n: v for n, v in state.items() if n not in skip}, "param_groups": groups}
    aliases = {k: v for k, v in (named.get("aliases") or {}).items() if k not in skip and k != v}
    aliases.update({new: old for old, new in rename.items()})
    out.pop("aliases", None)
    if aliases:
        out["aliases"] = aliases
    return out


def load(
    path: Any,
    local: Sequence[str],
    weights_only: bool | None,
    plain: Callable[[Any, bool | None], dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """This rank's view of the checkpoint at ``path`` (the values of the state-dict names
    ``local``) and the asynchronous schedules' saved state, if any. ``plain`` reads a checkpoint
    that is not a pipeline's (Lightning's own loader); its optimizer states, by position in the
    unsplit model, are kept and marked (``PLAIN_OPTIMIZERS``) for the optimizers to map by name."""
    async_state = None
    if is_pipeline_checkpoint(path):
        meta, shards = read_checkpoint(path, weights_only, names=local)  # checks the local tensors only
        checkpoint = {k: v for k, v in meta.items() if k != "lightning_pipe"}
        merged = merged_state_dict(shards)
        checkpoint["optimizer_states"] = merged_optimizer_states(shards)
        if checkpoint["optimizer_states"] is None:
            del checkpoint["optimizer_states"]
        async_state = merged_async_state(shards) or merged_elastic_state(shards)
    elif Path(path).is_dir():  # Lightning's loader would fail with a bare IsADirectoryError
        raise FileNotFoundError(not_a_checkpoint(path))
    else:
        checkpoint = plain(path, weights_only)
        merged = checkpoint["state_dict"]
        if "optimizer_states" in checkpoint:
            checkpoint[PLAIN_OPTIMIZERS] = True
    missing = [k for k in local if k not in merged]
    if missing:
        raise KeyError(f"The checkpoint {path} has no values for {missing[:5]} (of {len(missing)} missing).")
    checkpoint["state_dict"] = {k: merged[k] for k in local}
    return checkpoint, async_state
