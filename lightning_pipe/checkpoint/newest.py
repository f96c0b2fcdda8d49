"""The newest complete checkpoint in a folder: what an elastic restart resumes from.

A candidate is a checkpoint directory in the folder (not a hidden staging ``.name.partial`` or a
swapped-out ``.name.old``); candidates are tried newest first (by the step and epoch of their save
tag, then by time), and the first whose files are all there, of one save, and match every
checksum recorded when they were written is taken (:func:`~lightning_pipe.checkpoint.files.read`
compares every tensor). The newer ones it passed over are named with why. Where ``fit`` was given a
checkpoint too, only the folder's later saves are candidates (``after``: :func:`saved_at` of the given one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.checkpoint.files import META, is_pipeline_checkpoint, read


@dataclass(frozen=True)
class Found:
    """The checkpoint to resume from and the newer candidates refused (``"path: why"`` each)."""

    path: Path
    step: int
    epoch: int
    refused: tuple[str, ...] = ()


def _order(path: Path) -> tuple[int, int, float]:
    """(step, epoch, time) of the save in ``path``; a metadata file that cannot be read sorts first
    (it is still tried, and refused with the reason)."""
    try:
        tag: Any = torch.load(path / META, map_location="cpu", weights_only=True)["lightning_pipe"].get("save") or {}
        return int(tag.get("global_step") or 0), int(tag.get("epoch") or 0), (path / META).stat().st_mtime
    except Exception:
        return -1, -1, 0.0


def candidates(folder: str | Path) -> list[Path]:
    """The checkpoint directories in ``folder``, newest first (a link to one counts once)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    seen: dict[Path, Path] = {}
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(".") or not is_pipeline_checkpoint(entry):
            continue
        seen.setdefault(entry.resolve(), entry)
    return sorted(seen.values(), key=_order, reverse=True)


def newest_complete(folder: str | Path, after: tuple[int, int] | None = None) -> Found | None:
    """The newest checkpoint in ``folder`` that loads whole and checks (None: there is none), of a
    later save than ``after`` (step, epoch) where given: only those are read."""
    refused: list[str] = []
    for path in candidates(folder):
        if after is not None and _order(path)[:2] <= after:
            break
        try:
            meta, _ = read(path)
        except Exception as error:
            refused.append(f"{path}: {type(error).__name__}: {error}")
            continue
        tag = meta["lightning_pipe"].get("save") or {}
        step, epoch = int(tag.get("global_step") or meta.get("global_step") or 0), int(tag.get("epoch") or 0)
        return Found(path, step, epoch, tuple(refused))
    return None


def saved_at(path: str | Path) -> tuple[int, int] | None:
    """(step, epoch) of the save at ``path``: a pipeline checkpoint's save tag, or a plain Lightning
    file's counters (memory-mapped: no tensor is read); None where ``path`` names no checkpoint that
    can be read (such as Lightning's ``"last"``)."""
    path = Path(path)
    if is_pipeline_checkpoint(path):
        step, epoch, _ = _order(path)
        return (step, epoch) if step >= 0 else None
    try:
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        return int(saved.get("global_step") or 0), int(saved.get("epoch") or 0)
    except Exception:
        return None
