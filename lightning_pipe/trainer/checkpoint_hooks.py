"""What ``PipelineStrategy``'s checkpoint hooks do on one rank: Lightning's checkpoint calls with
the optimizer state keyed by parameter name, the files written and read per stage (see
:mod:`lightning_pipe.checkpoint.stage_io`), and whole tensors split into this replica's shards
under ``data_parallel="shard"``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe.checkpoint import (
    optimizer_state_by_name,
    optimizer_state_by_position,
    parameter_names,
    plain_state_by_name,
    stage_io,
)
from lightning_pipe.runtime.replicas.sharding import is_dtensor, shard_like
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
    current = module.state_dict()
    checkpoint, async_state = stage_io.load(checkpoint_path, list(current), weights_only, load_file)
    check_shapes(checkpoint.get("state_dict") or {}, current, checkpoint_path)
    return checkpoint, async_state


def check_shapes(saved: Mapping[str, Any], current: Mapping[str, Any], path: Any) -> None:
    """Refuse, naming the checkpoint, tensors whose saved shape is not this module's (Lightning's own
    ``size mismatch`` names neither the file nor how to fix it)."""
    wrong = [
        f"{name}: {tuple(value.shape)} in the checkpoint, {tuple(current[name].shape)} here"
        for name, value in saved.items()
        if name in current and isinstance(value, Tensor) and tuple(value.shape) != tuple(current[name].shape)
    ]
    if wrong:
        raise RuntimeError(
            f"lightning-pipe: the checkpoint {path} was saved from a module of other shapes: {'; '.join(wrong[:3])}"
            f"{f' (and {len(wrong) - 3} more)' if len(wrong) > 3 else ''}. Resume it with the module it was saved "
            "from; under elastic=..., it is the newest complete checkpoint of the watched folder: give this run an "
            "empty folder."
        )


def load_optimizer_state_dict(
    module: nn.Module | None,
    optimizers: Sequence[Optimizer],
    checkpoint: Mapping[str, Any],
    sharded: bool,
    device: torch.device,
    by_name: Callable[[Optimizer], dict[str, Any]],
) -> None:
    """Each optimizer's state from the checkpoint's by-name states, in the optimizer's own order
    (``by_name``: an optimizer's state keyed by name, to map a plain Lightning checkpoint's)."""
    assert module is not None
    names = parameter_names(module)
    params = dict(module.named_parameters())
    states = checkpoint["optimizer_states"]
    if checkpoint.get(stage_io.PLAIN_OPTIMIZERS):
        states = [_plain_by_name(o, s, by_name, params) for o, s in zip(optimizers, states)]
    for optimizer, named in zip(optimizers, states):
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


def _plain_by_name(
    optimizer: Optimizer, plain: Mapping[str, Any], by_name: Callable[[Optimizer], dict[str, Any]], params: Any
) -> dict[str, Any]:
    """A plain Lightning checkpoint's optimizer state (by position in the unsplit model) by name: every
    rank's groups (a collective), merged in the unsplit order, name the positions."""
    mine = {k: v for k, v in by_name(optimizer).items() if k != "state"}
    every: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    try:
        return plain_state_by_name(plain, every, shapes)
    except ValueError as e:
        raise RuntimeError(
            f"lightning-pipe: the plain Lightning checkpoint's optimizer state does not map onto this run's "
            f"parameters ({e}): configure_optimizers must build the same parameter groups, in the model's order, "
            f"as the run that saved it. To start from its weights alone, fit without ckpt_path and load them "
            f"with PipelineStrategy(weights=...) or model.load_state_dict(torch.load(path)['state_dict'])."
        ) from e


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
