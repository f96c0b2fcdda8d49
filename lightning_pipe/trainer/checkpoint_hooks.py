"""What ``PipelineStrategy``'s checkpoint hooks do on one rank: Lightning's checkpoint calls with
the optimizer state keyed by parameter name, the files written and read per stage (see
:mod:`lightning_pipe.checkpoint.stage_io`), and whole tensors split into this replica's shards
under ``data_parallel="shard"``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe.checkpoint import optimizer_state_by_name, optimizer_state_by_position, parameter_names, stage_io
from lightning_pipe.runtime.sharding import is_dtensor, shard_like
from lightning_pipe.trainer import internals, random_states


def optimizer_state(
    module: nn.Module | None, optimizer: Optimizer, aliases: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``optimizer``'s state keyed by parameter name (so it loads under another layout); ``aliases``:
    this rank's copies of tied weights under the unsplit module's name (see :func:`tie_aliases`)."""
    assert module is not None  # the strategy's lightning_module, attached before any checkpoint hook
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    return optimizer_state_by_name(optimizer, parameter_names(module), aliases)


def save_checkpoint(
    checkpoint: dict[str, Any],
    filepath: Any,
    storage_options: Any | None,
    writer: stage_io.Writer,
    async_state: dict[str, Any] | None,
) -> None:
    """Write a checkpoint directory: every rank its stage's shard, rank 0 the shared metadata (with
    every rank's random state, gathered: see :mod:`.random_states`), published only once every rank
    wrote its part (see :mod:`lightning_pipe.checkpoint.stage_io`)."""
    if storage_options is not None:
        raise TypeError("PipelineStrategy.save_checkpoint does not take storage_options.")
    # the pipeline's own state: an asynchronous schedule's, or elastic averaging's (already keyed "elastic")
    extra = None if async_state is None else async_state if "elastic" in async_state else {"async": async_state}
    checkpoint = {**checkpoint, random_states.KEY: random_states.gathered(writer.random_key)}
    stage_io.save(checkpoint, Path(filepath), writer, extra)


def load_checkpoint(
    module: nn.Module | None, checkpoint_path: Any, weights_only: bool | None, load_file: Callable[..., Any]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """This rank's view of a checkpoint: the parameters of its stage, by name, from a pipeline
    checkpoint written under any number of stages (or a plain Lightning checkpoint read with
    ``load_file``), and the asynchronous schedule's saved state (None without one)."""
    assert module is not None
    return stage_io.load(checkpoint_path, list(module.state_dict()), weights_only, load_file)


def load_optimizer_state_dict(
    module: nn.Module | None,
    optimizers: Sequence[Optimizer],
    checkpoint: Mapping[str, Any],
    sharded: bool,
    device: torch.device,
) -> None:
    """Each optimizer's state from the checkpoint's by-name states, in the optimizer's own order."""
    assert module is not None
    names = parameter_names(module)
    params = dict(module.named_parameters())
    for optimizer, named in zip(optimizers, checkpoint["optimizer_states"]):
        if sharded:  # each state tensor shaped like its parameter becomes this replica's shard
            named = {
                **named,
                "state": {
                    name: {k: _shard_state(v, params[name]) for k, v in state.items()} if name in params else state
                    for name, state in named["state"].items()
                },
            }
        order = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        optimizer.load_state_dict(optimizer_state_by_position(named, order))
        internals.optimizer_to_device(optimizer, device)


def load_model_state_dict(module: nn.Module | None, checkpoint: Mapping[str, Any], strict: bool, sharded: bool) -> None:
    """As Lightning's, with whole tensors split into this replica's shards under ``shard``."""
    assert module is not None
    state_dict = checkpoint["state_dict"]
    if sharded:
        current = module.state_dict()
        state_dict = {k: shard_like(v, current[k]) if k in current else v for k, v in state_dict.items()}
    module.load_state_dict(state_dict, strict=strict)


def _shard_state(value: Any, param: Tensor) -> Any:
    """An optimizer state value, split like ``param`` when it has ``param``'s whole shape."""
    if isinstance(value, Tensor) and value.dim() > 0 and is_dtensor(param) and tuple(value.shape) == tuple(param.shape):
        return shard_like(value, param)
    return value


__all__ = [
    "load_checkpoint",
    "load_model_state_dict",
    "load_optimizer_state_dict",
    "optimizer_state",
    "save_checkpoint",
]
