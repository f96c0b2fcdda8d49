"""``fabric.save(path, state)`` and ``fabric.load(path, state)`` as the project's checkpoint directory.

Fabric hands the strategy a dictionary of the user's objects (``{"model": model, "optimizer": optimizer,
"step": 5}``). The pipelined module becomes the checkpoint's ``state_dict`` and the optimizers its
``optimizer_states``, each stage writing its own file as the Trainer's checkpoints do, so a Trainer
resumes a Fabric run's checkpoint and ``python -m lightning_pipe.checkpoint`` consolidates it; the rest
(numbers, a scheduler's state) goes to the metadata that rank 0 writes. Which key held the module and
which the optimizers is kept under ``"fabric"``, so that loading maps them back by key.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_pipe.assembly.loop import PlainPipeline
from lightning_pipe.checkpoint import stage_io
from lightning_pipe.checkpoint.files import META, is_pipeline_checkpoint

#: the metadata's record of the keys that held the pipelined module and the optimizers
KEYS = "fabric"


def stateful(value: Any) -> bool:
    """Whether ``value`` saves and restores itself (a scheduler, a gradient scaler), as Fabric reads it."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def parts(state: Mapping[str, Any], module: nn.Module) -> tuple[str | None, list[str], dict[str, Any]]:
    """The key of the pipelined ``module`` in ``state`` (None without it), the optimizers' keys and the rest."""
    module_key, optimizers, rest = None, [], {}
    for key, value in state.items():
        if value is module:
            module_key = key
        elif isinstance(value, nn.Module):
            raise ValueError(
                f"fabric.save/load's state[{key!r}] is a module other than the pipelined one, which no stage file "
                "holds. Save it under its own file (torch.save(module.state_dict(), ...)) or pass its state_dict()."
            )
        elif isinstance(value, Optimizer):
            optimizers.append(key)
        else:
            rest[key] = value
    return module_key, optimizers, rest


def save(pipe: PlainPipeline, path: str | Path, state: Mapping[str, Any], filter: Any = None) -> None:
    """Every rank writes its stage's part of ``state`` to the checkpoint directory ``path``."""
    if filter:
        raise ValueError(
            "fabric.save(filter=...) is not supported by the pipeline strategy: each stage writes its whole stage. "
            "Leave filter out; consolidate the checkpoint (python -m lightning_pipe.checkpoint) and filter that."
        )
    module_key, optimizer_keys, rest = parts(state, pipe.module)
    extra = {key: value.state_dict() if stateful(value) else value for key, value in rest.items()}
    extra[KEYS] = {"module": module_key, "optimizers": optimizer_keys}
    pipe.save(path, [state[key] for key in optimizer_keys], **extra)


def saved_keys(path: str | Path) -> dict[str, Any] | None:
    """The keys a Fabric save recorded (None for a Trainer's checkpoint or a plain file)."""
    if not is_pipeline_checkpoint(path):
        return None
    return torch.load(Path(path) / META, weights_only=True).get(KEYS)


def load(
    pipe: PlainPipeline, path: str | Path, state: dict[str, Any], strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Restore ``state``'s objects in place from ``path`` (each rank its stage's part); returns what the
    checkpoint holds beyond them, as Fabric's own strategies do."""
    _, optimizer_keys, rest = parts(state, pipe.module)
    saved = saved_keys(path)
    order = saved["optimizers"] if saved is not None else optimizer_keys  # a Trainer's: by position
    if sorted(order) != sorted(optimizer_keys) and (strict or not set(optimizer_keys) <= set(order)):
        raise KeyError(
            f"fabric.load's state names the optimizers {optimizer_keys} and the checkpoint {path} holds {order}. "
            "Pass the same keys as the save did."
        )
    given = {key: state[key] for key in optimizer_keys}
    remainder = pipe.load(path, [given[key] for key in order if key in given])
    remainder.pop(KEYS, None)
    missing = [key for key in rest if key not in remainder]
    if strict and missing:
        raise KeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the checkpoint {path}. "
            "Pass strict=False to leave it as it is."
        )
    for key, value in rest.items():
        if key in remainder:
            if stateful(value):
                value.load_state_dict(remainder.pop(key))
            else:
                state[key] = remainder.pop(key)
    return remainder


def load_module(pipe: PlainPipeline, path: str | Path, strict: bool, weights_only: bool | None) -> None:
    """``fabric.load_raw(path, model)``: this rank's stage from a checkpoint directory, or from a plain file
    of the unsplit module's ``state_dict()``."""
    if is_pipeline_checkpoint(path):
        pipe.load(path)
        return

    def read(file: Any, weights: bool | None) -> dict[str, Any]:
        return {"state_dict": torch.load(file, weights_only=weights)}

    local = list(pipe.module.state_dict())
    checkpoint, _ = stage_io.load(path, local, True if weights_only is None else weights_only, read)
    pipe.module.load_state_dict(checkpoint["state_dict"], strict=strict)
