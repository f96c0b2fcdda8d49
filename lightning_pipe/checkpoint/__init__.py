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
"""

from __future__ import annotations

import argparse
import heapq
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

META = "meta.pt"
FORMAT = "lightning-pipe/1"
_PATH = Union[str, Path]


def shard_name(rank: int) -> str:
    return f"stage-{rank:05d}.pt"


def is_pipeline_checkpoint(path: _PATH) -> bool:
    path = Path(path)
    return path.is_dir() and (path / META).is_file()


# ---------------------------------------------------------------------------- optimizer state by name
def optimizer_state_by_name(optimizer: Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names instead of positions.

    ``names`` maps ``id(parameter)`` to its name in the unsplit module.
    """
    state = optimizer.state_dict()
    position_to_name: dict[int, str] = {}
    position = 0
    groups = []
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        group_names = []
        for param in group["params"]:
            position_to_name[position] = names[id(param)]
            group_names.append(names[id(param)])
            position += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": group_names})
    by_name = {position_to_name[p]: value for p, value in state["state"].items()}
    return {"state": by_name, "param_groups": groups}


def optimizer_state_by_position(named: Mapping[str, Any], order: Sequence[Sequence[str]]) -> dict[str, Any]:
    """The inverse: a ``state_dict`` for an optimizer whose groups hold the parameters named in
    ``order`` (one list per group), taking the states that exist under those names."""
    if len(order) != len(named["param_groups"]):
        raise ValueError(
            f"The checkpoint's optimizer has {len(named['param_groups'])} parameter groups but this one has "
            f"{len(order)}; configure_optimizers must build the same groups."
        )
    state: dict[int, Any] = {}
    groups = []
    position = 0
    for saved, group_names in zip(named["param_groups"], order):
        positions = []
        for name in group_names:
            if name in named["state"]:
                state[position] = named["state"][name]
            positions.append(position)
            position += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": positions})
    return {"state": state, "param_groups": groups}


def merge_optimizer_states(per_stage: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One optimizer's by-name state over all stages: states unioned, group members merged in the
    unsplit module's order (each stage lists its members in that order)."""
    state: dict[str, Any] = {}
    for part in per_stage:
        state.update(part["state"])
    groups = []
    for g, first in enumerate(per_stage[0]["param_groups"]):
        members = merge_orders([part["param_groups"][g]["params"] for part in per_stage])
        groups.append({**{k: v for k, v in first.items() if k != "params"}, "params": members})
    return {"state": state, "param_groups": groups}


def merge_orders(lists: Sequence[Sequence[str]]) -> list[str]:
    """The one order consistent with every list (each a subsequence of it), preferring earlier
    stages: parameters outside the Sequential appear in several lists and pin the stages'
    parameters around them."""
    after: dict[str, set[str]] = {}
    incoming: dict[str, int] = {}
    rank: dict[str, tuple[int, int]] = {}
    for s, names in enumerate(lists):
        for i, name in enumerate(names):
            rank.setdefault(name, (s, i))
            after.setdefault(name, set())
            incoming.setdefault(name, 0)
        for a, b in zip(names, names[1:]):
            if b not in after[a]:
                after[a].add(b)
                incoming[b] += 1
    ready = [(rank[n], n) for n, count in incoming.items() if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for nxt in after[name]:
            incoming[nxt] -= 1
            if incoming[nxt] == 0:
                heapq.heappush(ready, (rank[nxt], nxt))
    if len(order) != len(rank):
        raise ValueError("The stages list their optimizer parameters in contradicting orders.")
    return order


# ---------------------------------------------------------------------------- files
def save_tag(checkpoint: Mapping[str, Any], token: str) -> dict[str, Any]:
    """What every file of one save carries, so that a shard from another save is recognised:
    ``token`` is drawn once per save and shared by all ranks; step and epoch are for the message."""
    return {"token": token, "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}


def staging_path(path: _PATH) -> Path:
    """Where a save is written before it replaces ``path`` (same folder, so the rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def publish(staged: _PATH, path: _PATH) -> None:
    """Replace ``path`` by the complete save ``staged``. The previous checkpoint stays whole until
    the new one is: a crash while saving leaves it loadable."""
    staged, path = Path(staged), Path(path)
    old = path.with_name(f".{path.name}.old")
    _remove(old)
    if path.exists() or path.is_symlink():
        path.rename(old)
    staged.rename(path)
    _remove(old)


def prepare_staging(path: _PATH) -> Path:
    """An empty staging directory for a save to ``path`` (left-overs of a crashed save removed)."""
    staged = staging_path(path)
    _remove(staged)
    staged.mkdir(parents=True)
    return staged


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_shard(
    path: _PATH,
    rank: int,
    state_dict: Mapping[str, Tensor],
    optimizer_states: Optional[list],
    extra: Optional[dict[str, Any]] = None,
    tag: Optional[dict[str, Any]] = None,
) -> None:
    """Stage ``rank``'s shard; ``extra`` holds strategy state such as an asynchronous schedule's
    gradients not yet applied (keyed by layer name as well); ``tag`` names the save it belongs to."""
    shard = {
        "state_dict": {k: v.detach().cpu() for k, v in state_dict.items()},
        "optimizer_states": optimizer_states,
        "extra": _to_cpu(extra),
        "save": tag,
    }
    torch.save(shard, Path(path) / shard_name(rank))


_IN_DCP = "__in_dcp__"  # a shard's placeholder for a tensor stored in its DCP directory


def dcp_name(stage: int) -> str:
    return f"stage-{stage:05d}.dcp"


def write_sharded_stage(
    path: _PATH,
    stage: int,
    state_dict: Mapping[str, Tensor],
    optimizer_states: Optional[list],
    group: Any,
    write_index: bool,
    extra: Optional[dict[str, Any]] = None,
    tag: Optional[dict[str, Any]] = None,
) -> None:
    """A stage sharded over the replicas in ``group`` (FSDP2): every replica writes its parts of the
    sharded tensors through ``torch.distributed.checkpoint`` into ``stage-NNNNN.dcp``; one replica
    (``write_index``) writes ``stage-NNNNN.pt`` with everything else and a placeholder per tensor."""
    import torch.distributed.checkpoint as dcp

    from lightning_pipe.runtime.sharding import is_dtensor

    tensors: dict[str, Tensor] = {}

    def place(key: str, value: Any) -> Any:
        if is_dtensor(value):
            tensors[key] = value
            return _IN_DCP
        return value.detach().cpu() if isinstance(value, Tensor) else value

    index_state = {k: place(f"state_dict/{k}", v) for k, v in state_dict.items()}
    index_optim = None
    if optimizer_states is not None:
        index_optim = [
            {**named, "state": {n: {k: place(f"optimizer/{i}/{n}/{k}", v) for k, v in st.items()} for n, st in named["state"].items()}}
            for i, named in enumerate(optimizer_states)
        ]
    dcp.save(tensors, checkpoint_id=str(Path(path) / dcp_name(stage)), process_group=group)
    if write_index:
        shard = {"state_dict": index_state, "optimizer_states": index_optim, "extra": _to_cpu(extra), "save": tag}
        shard["dcp"] = dcp_name(stage)
        torch.save(shard, Path(path) / shard_name(stage))


def _fill_from_dcp(path: Path, shard: dict[str, Any]) -> dict[str, Any]:
    """A shard written by :func:`write_sharded_stage` with its placeholders replaced by the whole
    tensors (read without a process group)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    tensors: dict[str, Any] = {}
    _load_state_dict(tensors, storage_reader=FileSystemReader(str(path / shard["dcp"])), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    shard = dict(shard)
    shard["state_dict"] = {k: tensors[f"state_dict/{k}"] if v == _IN_DCP else v for k, v in shard["state_dict"].items()}
    if shard.get("optimizer_states") is not None:
        shard["optimizer_states"] = [
            {
                **named,
                "state": {
                    n: {k: tensors[f"optimizer/{i}/{n}/{k}"] if isinstance(v, str) and v == _IN_DCP else v for k, v in st.items()}
                    for n, st in named["state"].items()
                },
            }
            for i, named in enumerate(shard["optimizer_states"])
        ]
    return shard


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def merged_async_state(shards: Sequence[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """An asynchronous schedule's state over all stages: the step counter and, per batch, the
    unapplied gradient of every layer (by name)."""
    states = [(shard.get("extra") or {}).get("async") for shard in shards]
    if any(state is None for state in states):
        return None
    pending: dict[int, dict[str, Any]] = {}
    for state in states:
        for batch, grads in state["pending"].items():
            pending.setdefault(int(batch), {}).update(grads)
    return {"step": states[0]["step"], "pending": pending}


def write_meta(path: _PATH, checkpoint: Mapping[str, Any], num_stages: int, tag: Optional[dict[str, Any]] = None) -> None:
    meta = dict(checkpoint)
    meta["lightning_pipe"] = {"format": FORMAT, "num_stages": num_stages, "save": tag}
    torch.save(meta, Path(path) / META)


def _load(file: Path, **kwargs: Any) -> Any:
    try:
        return torch.load(file, map_location="cpu", **kwargs)
    except Exception as error:
        raise RuntimeError(
            f"The checkpoint file {file} cannot be read ({type(error).__name__}: {error}); it is damaged or "
            "truncated (a save that did not finish?). Resume from another checkpoint."
        ) from error


def _describe(tag: Optional[Mapping[str, Any]]) -> str:
    if not tag:
        return "an unknown save"
    return f"the save of step {tag.get('global_step')} (epoch {tag.get('epoch')})"


def read(path: _PATH, weights_only: Optional[bool] = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The metadata and every stage's shard (tensors memory-mapped). Refuses a checkpoint with a
    missing, unreadable or foreign shard (one written by another save), naming the file."""
    path = Path(path)
    if not is_pipeline_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a lightning-pipe checkpoint directory (no {META} in it).")
    meta = _load(path / META, weights_only=True if weights_only is None else weights_only)
    count = meta["lightning_pipe"]["num_stages"]
    tag = meta["lightning_pipe"].get("save")
    shards = []
    for rank in range(count):
        file = path / shard_name(rank)
        if not file.is_file():
            raise FileNotFoundError(f"{path} is incomplete: {file.name} is missing (the checkpoint has {count} stages).")
        shard = _load(file, weights_only=True, mmap=True)
        if shard.get("save") != tag:
            raise RuntimeError(
                f"{file} belongs to {_describe(shard.get('save'))}, but {path / META} to {_describe(tag)}: the "
                "directory mixes shards of different saves, and loading it would start from inconsistent weights. "
                "Put back the shard written with the rest of this checkpoint, or resume from another one."
            )
        shards.append(_fill_from_dcp(path, shard) if shard.get("dcp") else shard)
    return meta, shards


def merged_state_dict(shards: Iterable[Mapping[str, Any]]) -> dict[str, Tensor]:
    merged: dict[str, Tensor] = {}
    for shard in shards:
        merged.update(shard["state_dict"])
    return merged


def merged_optimizer_states(shards: Sequence[Mapping[str, Any]]) -> Optional[list[dict[str, Any]]]:
    if any(shard.get("optimizer_states") is None for shard in shards):
        return None
    count = len(shards[0]["optimizer_states"])
    return [merge_optimizer_states([shard["optimizer_states"][i] for shard in shards]) for i in range(count)]


def consolidate(path: _PATH, output: Optional[_PATH] = None, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """A plain Lightning checkpoint of the unsplit module from a pipeline checkpoint: the full
    ``state_dict``, and optimizer states by position as ``torch.optim`` saves them. Written to
    ``output`` when given; ``LightningModule.load_from_checkpoint`` and ``Trainer.fit(ckpt_path=...)``
    without the pipeline accept it."""
    meta, shards = read(path, weights_only)
    checkpoint = {k: v for k, v in meta.items() if k != "lightning_pipe"}
    checkpoint["state_dict"] = {k: v.clone() for k, v in merged_state_dict(shards).items()}
    named = merged_optimizer_states(shards)
    if named is not None:
        checkpoint["optimizer_states"] = [
            optimizer_state_by_position(opt, [g["params"] for g in opt["param_groups"]]) for opt in named
        ]
    if output is not None:
        torch.save(checkpoint, output)
    return checkpoint


def parameter_names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pipe.checkpoint",
        description="Turn a lightning-pipe checkpoint directory into a plain Lightning checkpoint file.",
    )
    parser.add_argument("checkpoint", help="the pipeline checkpoint directory")
    parser.add_argument("output", help="the plain checkpoint file to write")
    args = parser.parse_args(argv)
    checkpoint = consolidate(args.checkpoint, args.output)
    print(f"wrote {args.output}: {len(checkpoint['state_dict'])} tensors")

