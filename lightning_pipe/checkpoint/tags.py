"""The save tag: what every file of one save carries, so that a file of another save is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional


def save_tag(checkpoint: Mapping[str, Any], token: str) -> dict[str, Any]:
    """``token`` is drawn once per save and shared by all ranks; step and epoch are for the message."""
    return {"token": token, "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}


def describe(tag: Optional[Mapping[str, Any]]) -> str:
    if not tag:
        return "an unknown save"
    return f"the save of step {tag.get('global_step')} (epoch {tag.get('epoch')})"


def foreign(file: Path, found: Optional[Mapping[str, Any]], meta: Path, tag: Optional[Mapping[str, Any]]) -> RuntimeError:
    """The error for ``file``, tagged ``found``, in a checkpoint whose metadata ``meta`` is tagged ``tag``."""
    return RuntimeError(
        f"{file} belongs to {describe(found)}, but {meta} to {describe(tag)}: the "
        "directory mixes shards of different saves, and loading it would start from inconsistent weights. "
        "Put back the shard written with the rest of this checkpoint, or resume from another one."
    )


__all__ = ["describe", "foreign", "save_tag"]
