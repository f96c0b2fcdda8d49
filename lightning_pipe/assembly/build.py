"""``build_pipeline``: a module and the run's arguments to this rank's pipeline, for a plain PyTorch loop.

The same steps as the Trainer's setup (:mod:`lightning_pipe.assembly.split`): the arguments checked
(:class:`~lightning_pipe.config.PipelineConfig`), the ``nn.Sequential`` split with only this rank's
stages kept (materialised where the module was built on the meta device, loaded from ``weights=``),
the process groups of the layout, then the :class:`~lightning_pipe.runtime.pipeline.StagePipeline`
wrapped in a :class:`~lightning_pipe.assembly.loop.PlainPipeline` whose verbs take whole batches.
The process group is the caller's (``torchrun`` and ``torch.distributed.init_process_group``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.assembly.loop import PlainPipeline, broadcast
from lightning_pipe.assembly.split import SplitCalls, gather_objects, pipeline_for, split_module
from lightning_pipe.config import PipelineConfig, split_arguments
from lightning_pipe.partition.measure.measured import MeasureInputs
from lightning_pipe.partition.solvers.rank_order import check_rank_order
from lightning_pipe.runtime.topology import Layout, Topology

log = logging.getLogger(__name__)


def build_pipeline(
    module: nn.Module, /, *, device: torch.device | str | None = None, **arguments: Any
) -> PlainPipeline:
    """This rank's share of ``module``, split into a pipeline over the default process group.

    Args:
        module: the model; its only top-level ``nn.Sequential`` (or ``module=``'s) is split. It is
            changed in place: it keeps only this rank's stages, under their original names.
        device: where this rank's stages run; default ``cuda:LOCAL_RANK`` under NCCL, else the CPU.
        arguments: :class:`PipelineStrategy`'s arguments by their names (``schedule``, ``chunks``,
            ``balance``, ``stages``, ``recompute``, ...).
    """
    config, _ = split_arguments(arguments, ())  # a wrong argument is told before anything starts
    refuse_trainer_arguments(config)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "build_pipeline needs the process group first: launch with `torchrun --nproc-per-node=N train.py` and "
            "call torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (GPUs) before it."
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    here = resolve_device(device)
    inputs = MeasureInputs(_no_batch, here, rank == 0, broadcast, gather=gather_objects())
    split = split_module(module, config, layout_of(world, config), rank, inputs, SplitCalls(_on_rank_zero(rank)))
    module.to(here)  # only this rank's stages hold tensors
    topology = Topology(split.placement.layout, rank, here.type)
    return PlainPipeline(module, split, topology, pipeline_for(module, split, topology))


def refuse_trainer_arguments(config: PipelineConfig) -> None:
    """The arguments that need the Trainer's loop around them."""
    if config.elastic is not False:
        raise ValueError(
            f"build_pipeline(elastic={config.elastic!r}): elastic restarts resume the Trainer's own checkpoints. "
            "Leave elastic unset in a plain loop (save with pipeline.save and restart torchrun yourself), or use "
            "Trainer(strategy=PipelineStrategy(elastic=True))."
        )


def layout_of(world: int, config: PipelineConfig) -> Layout:
    """Stages x replicas of ``world`` processes (``stages=``; default: one pipeline over them all), placed by
    ``rank_order=`` where given."""
    layout = Layout.of(world, config.stages)
    if config.rank_order is None:
        return layout
    check_rank_order(config.rank_order, world)
    return layout.placed(config.rank_order)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device``, or this rank's GPU where the process group runs NCCL (``LOCAL_RANK``, as torchrun sets it)."""
    if device is not None:
        return torch.device(device)
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _no_batch() -> Any:
    raise ValueError(
        "balance='time'/'memory' and plan='auto' measure the run's first batch, which build_pipeline does not "
        "have. Use balance='uniform', 'parameters' or a list of layer counts per stage."
    )


def _on_rank_zero(rank: int) -> Any:
    """The split's lines, told once (by global rank 0) through the logging module."""
    return log.info if rank == 0 else (lambda line: None)
