"""The save tag: what every file of one save carries, so that a file of another save is refused."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def save_tag(checkpoint: Mapping[str, Any], token: str) -> dict[str, Any]:
    """``token`` is drawn once per save and shared by all ranks; step and epoch are for the message."""
    return {"token": token, "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}


def describe(tag: Mapping[str, Any] | None) -> str:
    if not tag:
        return "an unknown save"
    return f"the save of step {tag.get('global_step')} (epoch {tag.get('epoch')})"


def _short(tag: Mapping[str, Any]) -> str:
    """A save's id as a message shows it: the first 8 characters of its random token."""
    return str(tag.get("token"))[:8]


def foreign(file: Path, found: Mapping[str, Any] | None, meta: Path, tag: Mapping[str, Any] | None) -> RuntimeError:
    """The error for ``file``, tagged ``found``, in a checkpoint whose metadata ``meta`` is tagged ``tag``
    (saves of the same step and epoch are told apart by their save ids)."""
    if found and tag and describe(found) == describe(tag):
        where = (
            f"{file} belongs to another save at the same step {tag.get('global_step')} (epoch {tag.get('epoch')}) than "
            f"{meta}: save id {_short(found)} against {_short(tag)} (another run, or the same step saved twice)"
        )
    else:
        where = f"{file} belongs to {describe(found)}, but {meta} to {describe(tag)}"
    return RuntimeError(
        f"{where}: the "
        "directory mixes shards of different saves, and loading it would start from inconsistent weights. "
        "Put back the shard written with the rest of this checkpoint, or resume from another one."
    )
