"""Writing a checkpoint beside its target and swapping it in whole, so that a crash while saving
leaves the previous checkpoint loadable."""

from __future__ import annotations

import shutil
from pathlib import Path

_PATH = str | Path


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
