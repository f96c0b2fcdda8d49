"""A stage sharded over its replicas (FSDP2): its sharded tensors go through
``torch.distributed.checkpoint`` into ``stage-NNNNN.dcp`` (every replica writes its part), and come
back whole without a process group, once every file of the directory matches the checksum and the
directory the save tag recorded with it."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_pipe.checkpoint import checksums
from lightning_pipe.checkpoint.tags import foreign

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

IN_DCP = "__in_dcp__"  # the index's placeholder for a tensor stored in the DCP directory
_TAG = "save"  # the save tag's key in a DCP directory


def dcp_name(stage: int) -> str:
    return f"stage-{stage:05d}.dcp"


def write_parts(
    directory: Path,
    state_dict: Mapping[str, Tensor],
    optimizer_states: list | None,
    group: ProcessGroup | None,
    tag: dict[str, Any] | None,
) -> tuple[dict[str, Any], list | None]:
    """Write this replica's parts of the sharded tensors (DTensors) into ``directory``, with the
    save ``tag``; returns the state dict and optimizer states for the index, each such tensor
    replaced by a placeholder and every other one on the CPU. Every replica's part is complete when
    it returns."""
    import torch.distributed.checkpoint as dcp

    from lightning_pipe.runtime.replicas.sharding import is_dtensor

    tensors: dict[str, Any] = {}

    def place(key: str, value: Any) -> Any:
        if is_dtensor(value):
            tensors[key] = value
            return IN_DCP
        return value.detach().cpu() if isinstance(value, Tensor) else value

    index_state = {k: place(f"state_dict/{k}", v) for k, v in state_dict.items()}
    index_optim = None
    if optimizer_states is not None:
        index_optim = [
            {
                **named,
                "state": {
                    n: {k: place(f"optimizer/{i}/{n}/{k}", v) for k, v in st.items()}
                    for n, st in named["state"].items()
                },
            }
            for i, named in enumerate(optimizer_states)
        ]
    if tag is not None:  # the parts carry the save tag too, so that a directory of another save is recognised
        tensors[_TAG] = json.dumps(tag, sort_keys=True)  # text: DCP would flatten a mapping
    dcp.save(tensors, checkpoint_id=str(directory), process_group=group)
    return index_state, index_optim


def part_checksums(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file of a written DCP directory: its size and CRC-32."""
    return {f.name: (f.stat().st_size, checksums.file_checksum(f)) for f in sorted(directory.iterdir()) if f.is_file()}


def fill(path: Path, shard: dict[str, Any], tag: Mapping[str, Any] | None, meta: Path) -> dict[str, Any]:
    """The index ``shard`` of the checkpoint ``path`` with its placeholders replaced by the whole
    tensors (read without a process group), once the DCP directory's files are checked against the
    index and the save ``tag`` of the checkpoint's metadata ``meta``."""
    directory = path / shard["dcp"]
    _check(path, directory, shard.get("dcp_files"), tag, meta)
    try:
        tensors = _read_all(directory)
        shard = dict(shard)
        shard["state_dict"] = {
            k: tensors[f"state_dict/{k}"] if v == IN_DCP else v for k, v in shard["state_dict"].items()
        }
        if shard.get("optimizer_states") is not None:
            shard["optimizer_states"] = [
                {
                    **named,
                    "state": {
                        n: {
                            k: tensors[f"optimizer/{i}/{n}/{k}"] if isinstance(v, str) and v == IN_DCP else v
                            for k, v in st.items()
                        }
                        for n, st in named["state"].items()
                    },
                }
                for i, named in enumerate(shard["optimizer_states"])
            ]
    except Exception as error:
        raise RuntimeError(
            f"The checkpoint part {directory} cannot be read ({type(error).__name__}: {error}); it is damaged, "
            "incomplete or not the one written with this checkpoint. Resume from another checkpoint."
        ) from error
    return shard


def _read_all(directory: Path) -> dict[str, Any]:
    """Every entry of a DCP directory, each tensor whole and on the CPU, read in this process alone:
    the directory's metadata gives each key's shape and dtype (or a non-tensor value)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(directory))
    entries = reader.read_metadata().state_dict_metadata
    found: dict[str, Any] = {
        key: torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
        for key, m in entries.items()
    }
    _load_here(found, reader)
    return found


def _load_here(found: dict[str, Any], reader: Any) -> None:
    """``dcp.load`` into ``found`` in this process alone, without its warning that it does so."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(found, storage_reader=reader, no_dist=True)


def _check(
    path: Path, directory: Path, files: Mapping[str, tuple[int, int]] | None, tag: Mapping[str, Any] | None, meta: Path
) -> None:
    """Refuse a DCP directory with a missing, truncated, changed or foreign file, naming it (a
    directory written before files were recorded is read unchecked)."""
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{path} is incomplete: {directory.name} is missing (the stage is sharded over its replicas)."
        )
    for name, (size, crc) in (files or {}).items():
        file = directory / name
        present = file.is_file()
        found_size = file.stat().st_size if present else -1
        if present and found_size == size and checksums.file_checksum(file) == crc:
            continue
        written = _tag(directory)
        if written is not None and written != tag:  # another save's: the whole directory where its index is
            raise foreign(directory if name == ".metadata" else file, written, meta, tag)
        if not present:
            raise FileNotFoundError(
                f"{path} is incomplete: {directory.name}/{name} is missing (written with this checkpoint)."
            )
        if found_size != size:
            raise RuntimeError(
                f"The checkpoint file {file} cannot be read: it has {found_size} bytes but was written with {size}; it "
                "is damaged or truncated (a save that did not finish?). Resume from another checkpoint."
            )
        raise checksums.damaged(file, checksums.mismatch("its content"))


def _tag(directory: Path) -> Any | None:
    """The save tag stored in a DCP directory, or None where it cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        found: dict[str, Any] = {_TAG: ""}
        _load_here(found, FileSystemReader(str(directory)))
        return json.loads(found[_TAG])
    except Exception:
        return None
