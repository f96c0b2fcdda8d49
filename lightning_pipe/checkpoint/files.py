"""A checkpoint directory's files: each stage's shard and the shared metadata, written with the
save tag and a checksum of every tensor, and read back refusing a missing, unreadable, damaged or
foreign file with an error that names it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_pipe.checkpoint import checksums, sharded
from lightning_pipe.checkpoint.merged import merged_state_dict
from lightning_pipe.checkpoint.optimizer_state import differing_hyperparameters
from lightning_pipe.checkpoint.tags import foreign

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

META = "meta.pt"
FORMAT = "lightning-pipe/1"
_PATH = str | Path
#: the parts of a stage file and of the metadata whose values other than tensors are checksummed
SHARD_VALUES = ("state_dict", "optimizer_states", "extra", "save", "dcp", "dcp_files")
META_VALUES = ("lr_schedulers",)


def shard_name(rank: int) -> str:
    return f"stage-{rank:05d}.pt"


def is_pipeline_checkpoint(path: _PATH) -> bool:
    path = Path(path)
    return path.is_dir() and (path / META).is_file()


def not_a_checkpoint(folder: _PATH) -> str:
    """Why ``folder`` (a folder without :data:`META`) is not a checkpoint, what one holds, and the
    checkpoints inside it, or in its ``checkpoints`` folder (a run's), to give instead."""
    folder = Path(folder)
    stages = sorted(p.name for p in folder.glob("stage-*.pt"))
    if stages:  # the stages' files without the metadata, which is written last
        return (
            f"{folder} is an incomplete checkpoint: it has {stages[0]} but no {META}, which a save writes last (a "
            "save that did not finish?). Resume from another checkpoint."
        )
    inside = [p for p in (*sorted(folder.iterdir()), *sorted(folder.glob("checkpoints/*"))) if _is_checkpoint_file(p)]
    found = f" Checkpoints in it: {', '.join(str(p.relative_to(folder)) for p in inside[:5])}." if inside else ""
    return (
        f"{folder} is a folder, not a checkpoint: a lightning-pipe checkpoint is a folder holding {META} and one "
        f"stage-NNNNN.pt per stage (such as epoch=1-step=12.ckpt/ or last.ckpt/), and a plain Lightning checkpoint "
        f"is one .ckpt file.{found} Give the path of a checkpoint."
    )


def _is_checkpoint_file(path: Path) -> bool:
    """A pipeline checkpoint, or a plain Lightning one (a ``.ckpt`` file)."""
    return is_pipeline_checkpoint(path) or (path.is_file() and path.suffix == ".ckpt")


# ---------------------------------------------------------------------------- writing
def write_shard(
    path: _PATH,
    rank: int,
    state_dict: Mapping[str, Tensor],
    optimizer_states: list | None,
    extra: dict[str, Any] | None = None,
    tag: dict[str, Any] | None = None,
) -> None:
    """Stage ``rank``'s shard; ``extra`` holds strategy state such as an asynchronous schedule's
    gradients not yet applied (keyed by layer name as well); ``tag`` names the save it belongs to."""
    shard = {
        "state_dict": {k: v.detach().cpu() for k, v in state_dict.items()},
        "optimizer_states": optimizer_states,
        "extra": _to_cpu(extra),
        "save": tag,
    }
    _save(shard, Path(path) / shard_name(rank))


def write_sharded_stage(
    path: _PATH,
    stage: int,
    state_dict: Mapping[str, Tensor],
    optimizer_states: list | None,
    group: ProcessGroup | None,
    write_index: bool,
    extra: dict[str, Any] | None = None,
    tag: dict[str, Any] | None = None,
) -> None:
    """A stage sharded over the replicas in ``group`` (FSDP2): every replica writes its parts of the
    sharded tensors into ``stage-NNNNN.dcp`` (see :mod:`lightning_pipe.checkpoint.sharded`); one
    replica (``write_index``) writes ``stage-NNNNN.pt`` with everything else, a placeholder per
    tensor and the checksum of every file of the directory."""
    directory = Path(path) / sharded.dcp_name(stage)
    index_state, index_optim = sharded.write_parts(directory, state_dict, optimizer_states, group, tag)
    if write_index:
        shard = {"state_dict": index_state, "optimizer_states": index_optim, "extra": _to_cpu(extra), "save": tag}
        shard["dcp"] = directory.name
        shard["dcp_files"] = sharded.part_checksums(directory)
        _save(shard, Path(path) / shard_name(stage))


def write_meta(
    path: _PATH,
    checkpoint: Mapping[str, Any],
    num_stages: int,
    tag: dict[str, Any] | None = None,
    order: Sequence[str] = (),
) -> None:
    """The metadata every stage shares; ``order``: the unsplit module's state-dict names in its own order."""
    meta = dict(checkpoint)
    recorded = checksums.record(meta, META_VALUES)
    meta["lightning_pipe"] = {
        "format": FORMAT, "num_stages": num_stages, "save": tag, "checksums": recorded, "order": list(order),
    }  # fmt: skip
    torch.save(meta, Path(path) / META)


def _save(shard: dict[str, Any], file: Path) -> None:
    shard["checksums"] = checksums.record(shard, SHARD_VALUES)
    torch.save(shard, file)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


# ---------------------------------------------------------------------------- reading
def read(
    path: _PATH, weights_only: bool | None = None, names: Collection[str] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The metadata and every stage's shard (tensors memory-mapped). Refuses a checkpoint with a
    missing, unreadable, damaged or foreign shard (one written by another save), naming the file.

    Every tensor is compared with the checksum recorded when it was written, or, given ``names``
    (state-dict names), only those of these names (their values, optimizer states and pending
    gradients) and those of no name: a rank resuming its stage reads nothing of the others'."""
    meta, shards, verifiers = _open(path, weights_only)
    for verifier in verifiers:
        verifier.verify(names)
    return meta, shards


def read_state_dict(path: _PATH) -> tuple[dict[str, Tensor], Callable[[str], Tensor]]:
    """Every stage's tensors by name (memory-mapped, not yet read) and a reader that compares a
    tensor with the checksum recorded when it was written before it hands it out, so that
    ``weights=`` reads and checks only the tensors of a rank's stage."""
    _, shards, verifiers = _open(path, True)
    owners: dict[str, checksums.Verifier] = {}
    for shard, verifier in zip(shards, verifiers):
        verifier.verify(())
        owners.update(dict.fromkeys(shard["state_dict"], verifier))
    merged = merged_state_dict(shards)

    def checked(name: str) -> Tensor:
        owners[name].verify([name])
        return merged[name]

    return merged, checked


def _open(
    path: _PATH, weights_only: bool | None
) -> tuple[dict[str, Any], list[dict[str, Any]], list[checksums.Verifier]]:
    """The metadata (checked), every stage's shard (tensors memory-mapped and not yet compared with
    their checksums) and, per shard, what compares them."""
    path = Path(path)
    if path.is_dir() and not is_pipeline_checkpoint(path):
        raise FileNotFoundError(not_a_checkpoint(path))
    if not is_pipeline_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a lightning-pipe checkpoint directory (no {META} in it).")
    meta = _load(path / META, weights_only=True if weights_only is None else weights_only)
    count = meta["lightning_pipe"]["num_stages"]
    tag = meta["lightning_pipe"].get("save")
    checksums.Verifier(path / META, meta, meta["lightning_pipe"].get("checksums"), ()).verify()
    shards, verifiers = [], []
    for rank in range(count):
        file = path / shard_name(rank)
        if not file.is_file():
            raise FileNotFoundError(
                f"{path} is incomplete: {file.name} is missing (the checkpoint has {count} stages)."
            )
        shard = _load(file, weights_only=True, mmap=True)
        if shard.get("save") != tag:
            raise foreign(file, shard.get("save"), path / META, tag)
        verifier = checksums.Verifier(file, shard, shard.get("checksums"), shard.get("state_dict", {}))
        verifier.verify_values()
        verifiers.append(verifier)
        shards.append(sharded.fill(path, shard, tag, path / META) if shard.get("dcp") else shard)
    _same_hyperparameters([path / shard_name(rank) for rank in range(count)], shards)
    return meta, shards, verifiers


def _same_hyperparameters(files: list[Path], shards: list[dict[str, Any]]) -> None:
    """Every stage saves its optimizers' hyper-parameters; a resume uses stage 0's (the others hold
    the same), so stages that disagree are refused, naming the files."""
    if not shards or shards[0].get("optimizer_states") is None:
        return
    first = shards[0]["optimizer_states"]
    for file, shard in zip(files[1:], shards[1:]):
        difference = differing_hyperparameters(shard.get("optimizer_states"), first)
        if difference is not None:
            raise RuntimeError(
                f"{file} saved other optimizer hyperparameters than {files[0]} ({difference}): every stage saves the "
                "same ones and a resume takes stage 0's, so these files were not written together (or one was "
                "edited). Put back the stage files written with this checkpoint, or resume from another one."
            )


def _load(file: Path, **kwargs: Any) -> Any:
    try:
        return torch.load(file, map_location="cpu", **kwargs)
    except Exception as error:
        raise RuntimeError(
            f"The checkpoint file {file} cannot be read ({type(error).__name__}: {error}); it is damaged or "
            "truncated (a save that did not finish?). Resume from another checkpoint."
        ) from error
