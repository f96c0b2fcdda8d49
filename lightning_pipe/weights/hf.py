"""Read a directory that Hugging Face ``save_pretrained`` wrote (or a hub snapshot), opening only
the files that hold the tensors a process copies.

Such a directory holds its weights as (in the order ``from_pretrained`` looks for them):

- ``model.safetensors``: one file;
- ``model.safetensors.index.json`` and the shards ``model-0000k-of-0000N.safetensors`` it names:
  its ``weight_map`` says which shard holds each tensor;
- ``pytorch_model.bin``, or ``pytorch_model.bin.index.json`` and its ``.bin`` shards (older saves).

The whole model's names and shapes come from the index and from each safetensors shard's header
(its first bytes: a JSON table of names, shapes and offsets), read without touching any tensor
data, so every process checks the whole file against the whole model and gives the same answer.
A shard's data is opened (``safetensors.safe_open``, memory-mapped; ``.bin`` shards with
``torch.load(mmap=True)``) the first time one of its tensors is read, so a process opens only the
shards that hold its stage's tensors. The shapes of ``.bin`` shards are only known once opened:
they are checked when a tensor is copied.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
PRETRAINED_FILES = (SAFETENSORS, SAFETENSORS_INDEX, BIN, BIN_INDEX)  # from_pretrained's order
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the header's size

Shape = tuple[int, ...] | None  # None: not known until the file is opened


def pretrained_file(directory: Path) -> Path | None:
    """The file of ``directory`` that says where its weights are, or None when it is not a
    ``save_pretrained`` directory."""
    return next((directory / name for name in PRETRAINED_FILES if (directory / name).is_file()), None)


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes from a safetensors file's header, reading no tensor data (``safe_open``
    would map the whole file: the point is not to open shards of other stages)."""
    with open(path, "rb") as f:
        start = f.read(8)
        if len(start) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        (size,) = struct.unpack("<Q", start)
        if size > _MAX_HEADER:
            raise ValueError(f"{path} is not a safetensors file (its header would be {size} bytes)")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not a safetensors file (its header is not JSON: {err})") from err
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header is not a table of tensors)")
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    try:
        end = max((int(entry["data_offsets"][1]) for entry in tensors.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError) as err:
        raise ValueError(
            f"{path} is not a safetensors file (an entry of its header has no data_offsets: {err})"
        ) from err
    check_length(path, 8 + size + end)
    return {name: tuple(entry["shape"]) for name, entry in tensors.items()}


def check_length(path: Path, expected: int) -> None:
    """A safetensors file holds exactly the bytes its header describes; a copy or download that
    stopped early (or appended to) is refused naming the file, before safetensors' own
    ``incomplete metadata`` error, which names none."""
    actual = path.stat().st_size
    if actual < expected:
        raise ValueError(
            f"{path} is cut short: its header describes {expected} bytes, the file holds {actual} (a download or "
            "copy that did not finish?). Download or copy it again."
        )
    if actual > expected:
        raise ValueError(
            f"{path} is damaged: its header describes {expected} bytes, the file holds {actual} (bytes appended, or "
            "two writes mixed). Download or copy it again."
        )


class PretrainedFiles:
    """The tensors of one ``save_pretrained`` directory: ``shapes`` of all of them, ``read(name)``
    one, opening its file on first use; ``opened`` lists the files opened so far."""

    def __init__(self, directory: Path) -> None:
        found = pretrained_file(directory)
        if found is None:
            raise ValueError(f"{directory} holds none of {', '.join(PRETRAINED_FILES)}")
        self.directory, self.described_by = directory, found
        self.opened: list[Path] = []
        self._handles: dict[Path, Any] = {}
        self.files: dict[str, Path]  # tensor name -> its file
        self.shapes: dict[str, Shape]
        if found.name == SAFETENSORS:
            self.shapes = dict(safetensors_shapes(found))
            self.files = {name: found for name in self.shapes}
        elif found.name == BIN:  # one pickled file: its names only come from opening it
            state = self._handles[found] = self._open(found)
            self.shapes = {name: tuple(t.shape) for name, t in state.items()}
            self.files = {name: found for name in state}
        else:
            self.files = _weight_map(found)
            self.shapes = self._indexed_shapes(found)

    def _indexed_shapes(self, index: Path) -> dict[str, Shape]:
        """Every indexed tensor's shape from its safetensors shard's header (None in a .bin shard)."""
        shapes: dict[str, Shape] = {}
        headers: dict[Path, dict[str, tuple[int, ...]]] = {}
        for name, file in self.files.items():
            if file.suffix != ".safetensors":
                shapes[name] = None
                continue
            if file not in headers:
                headers[file] = safetensors_shapes(file)
            if name not in headers[file]:
                raise ValueError(f"{index.name} places {name!r} in {file.name}, which does not hold it")
            shapes[name] = headers[file][name]
        return shapes

    def read(self, name: str) -> Tensor:
        file = self.files[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = self._open(file)
        if file.suffix == ".safetensors":
            return handle.get_tensor(name)
        if name not in handle:
            raise ValueError(f"{self.described_by.name} places {name!r} in {file.name}, which does not hold it")
        return handle[name]

    def _open(self, file: Path) -> Any:
        self.opened.append(file)
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            return safe_open(str(file), framework="pt", device="cpu")
        loaded = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(loaded, dict) or not all(isinstance(v, Tensor) for v in loaded.values()):
            raise ValueError(f"{file} is not a state_dict (a mapping of names to tensors)")
        return loaded


def _weight_map(index: Path) -> dict[str, Path]:
    """Tensor name -> its shard, from an index file; every shard it names must be there."""
    try:
        table = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{index} is not JSON: {err}") from err
    weight_map = table.get("weight_map") if isinstance(table, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index} has no weight_map (tensor name -> shard file)")
    files = {name: index.parent / shard for name, shard in weight_map.items()}
    absent = sorted({p.name for p in files.values() if not p.is_file()})
    if absent:
        raise ValueError(f"{index} names shards that are not in {index.parent}: {', '.join(absent)}")
    return files
