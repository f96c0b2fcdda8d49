"""Which run an elastic checkpoint belongs to, so that a first start does not take another run's work.

An elastic start resumes from the newest complete checkpoint of its watched folder. A folder that
still holds an earlier run's checkpoints (another model, other hyperparameters) would hand that
run's weights to a new one. Each elastic save records its run here: torchrun's run id
(``TORCHELASTIC_RUN_ID``, shared by every restart of one ``torchrun``) and the module as ``fit`` got
it: its class, the names and shapes of its tensors (those it holds before ``configure_model``), and
its plain hyperparameters (``save_hyperparameters``). Before resuming, the start compares them:
another module or other hyperparameters are refused, naming the checkpoint and what differs; another
run id, or a checkpoint that records no run, is resumed and said plainly, on rank 0.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_pipe.checkpoint.files import META

STATE_KEY = "lightning_pipe.ElasticState"  # the callback state that holds the record (ElasticState.state_key)
_PLAIN = (bool, int, float, str, type(None))


def fingerprint(model: Any) -> dict[str, Any]:
    """The module's identity as a record of plain values: its class, how many tensors it holds and a
    digest of their names and shapes, and its hyperparameters that are plain values (others, whose text
    may change from one start to the next, are left out)."""
    tensors = model.state_dict() if hasattr(model, "state_dict") else {}
    described = ";".join(f"{name}:{tuple(t.shape)}" for name, t in tensors.items() if isinstance(t, torch.Tensor))
    hparams = getattr(model, "hparams", None) or {}
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "tensors": len(tensors),
        "shapes": hashlib.sha256(described.encode()).hexdigest()[:16],
        "hparams": {str(k): v for k, v in dict(hparams).items() if _plain(v)},
    }


def record(model_fingerprint: dict[str, Any] | None) -> dict[str, Any]:
    """What a save keeps of its run: torchrun's run id and the module's fingerprint."""
    return {"id": os.environ.get("TORCHELASTIC_RUN_ID"), "model": model_fingerprint}


def saved_record(path: str | Path) -> dict[str, Any] | None:
    """The run record in the pipeline checkpoint at ``path`` (None: it keeps none, or cannot be read)."""
    try:
        meta: Any = torch.load(Path(path) / META, map_location="cpu", weights_only=True)
    except Exception:
        return None
    state = (meta.get("callbacks") or {}).get(STATE_KEY) or {}
    run = state.get("run")
    return run if isinstance(run, dict) else None


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's module fingerprint and this start's, in words (empty: nothing)."""
    found = []
    if saved.get("class") != current.get("class"):
        found.append(f"the module is a {current.get('class')}, the checkpoint's a {saved.get('class')}")
    if (saved.get("tensors"), saved.get("shapes")) != (current.get("tensors"), current.get("shapes")):
        found.append(
            f"the module's tensors differ in names or shapes ({current.get('tensors')} tensors here, "
            f"{saved.get('tensors')} in the checkpoint)"
        )
    old, new = saved.get("hparams") or {}, current.get("hparams") or {}
    changed = sorted(k for k in set(old) | set(new) if old.get(k, "<unset>") != new.get(k, "<unset>"))
    if changed:
        shown = ", ".join(f"{k}={old.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}" for k in changed)
        found.append(f"the hyperparameters differ ({shown})")
    return found


def check(path: Path, step: int, folder: Path, current: dict[str, Any] | None, first_start: bool) -> str | None:
    """Whether this start may resume the folder's checkpoint ``path``: refused, naming it, where it holds
    another run's module; else what to say on rank 0 about where the resume comes from (None: nothing, a
    restart of the run that wrote it)."""
    saved, run_id = saved_record(path), os.environ.get("TORCHELASTIC_RUN_ID")
    where = f"{path} (step {step}), the newest complete checkpoint of the watched folder {folder}"
    if saved is None:
        return (
            f"lightning-pipe elastic: resuming from {where}; it records no run (saved without elastic, or by an "
            "earlier lightning-pipe), so it cannot be told from another run's. To start afresh, watch an empty folder."
        )
    if current is not None and saved.get("model") is not None:
        found = differences(saved["model"], current)
        if found:
            raise MisconfigurationException(
                f"lightning-pipe elastic: the watched folder {folder} holds {path} (step {step}), a checkpoint of "
                f"another run: {'; '.join(found)}. An elastic start resumes the newest complete checkpoint of its "
                "folder, and this one is not this run's. Give this run an empty folder (elastic=NEW_FOLDER, or "
                "another ModelCheckpoint dirpath), or move that run's checkpoints away; to continue from it on purpose "
                "with this module, pass it to fit(ckpt_path=...) without elastic."
            )
    if first_start or saved.get("id") != run_id:
        other = (
            "" if saved.get("id") == run_id else f" written by torchrun run {saved.get('id')!r} (this is {run_id!r}),"
        )
        return (
            f"lightning-pipe elastic: this start resumes from {where},{other} with this module's class, tensors and "
            "hyperparameters. To start afresh instead, watch an empty folder."
        )
    return None


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN)
