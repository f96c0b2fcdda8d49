"""The Trainer's side of the assembly (:mod:`lightning_pipe.assembly.split`): the run's first batch and
optimizers for measuring, the rank-zero lines Lightning prints, an elastic restart's arguments, and the
layout's refusals as Lightning's configuration error."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_pipe.assembly.split import (
    ModuleSplit,
    SplitCalls,
    SplitDecision,
    gather_objects,
    pipeline_for,
    pipeline_options,
)
from lightning_pipe.assembly.split import split_module as split_any_module
from lightning_pipe.config import PipelineConfig
from lightning_pipe.partition.measure.measured import MeasureInputs
from lightning_pipe.plan.restart_layout import restart_replicas_sync
from lightning_pipe.runtime.crossing.skips import routes_line
from lightning_pipe.runtime.pipeline import StagePipeline
from lightning_pipe.runtime.topology import Layout, Placement, Topology
from lightning_pipe.schedules import traits
from lightning_pipe.trainer.compatibility import as_misconfiguration
from lightning_pipe.trainer.dataloaders.loaders import configured_optimizers, first_batch
from lightning_pipe.trainer.launch.restarts import restart_count
from lightning_pipe.trainer.layout_report import activations_part, describe_layout, rank_info, tells_crossing
from lightning_pipe.trainer.traced_ends import traced_ends

log = logging.getLogger(__name__)


def split_module(
    module: Any,
    config: PipelineConfig,
    layout: Layout,
    rank: int,
    measure: tuple[torch.device, Callable[[Any, torch.device], Any], Callable[[Any], Any], Callable[[], Any]],
    previous: ModuleSplit | None = None,
) -> ModuleSplit:
    """Split the LightningModule in the strategy's setup (see :func:`lightning_pipe.assembly.split.split_module`).
    ``measure``: the rank's device, the strategy's batch mover, its broadcast and the precision's training
    context, for profiling the run's first batch."""
    config = for_this_world(config, layout.world_size, layout.replicas)
    device, to_device, broadcast, context = measure
    inputs = measure_inputs(module, to_device, device, rank == 0, broadcast, context)
    calls = SplitCalls(rank_zero_info, traced_ends, _describer(module))
    with as_misconfiguration():
        return split_any_module(module, config, layout, rank, inputs, calls, previous)


def _describer(module: Any) -> Callable[..., None]:
    """Where Lightning prints its setup lines: the layout that runs, its activations and its skip routes."""

    def describe(
        config: PipelineConfig,
        layout: Layout,
        decision: SplitDecision,
        placement: Placement,
        candidates: list[Any] | None,
        skips: dict[Any, Any],
    ) -> None:
        chunks = config.num_microbatches(layout.stages)
        assert decision.balance is not None  # known once split
        line = describe_layout(module.trainer, layout, decision.balance, decision.positions, config.schedule, chunks)
        options = pipeline_options(config, placement)
        predicted = candidates[0].activation_bytes if candidates else ()
        line += activations_part(options.activations.recompute, options.activations.offload, predicted)
        rank_zero_info(line + routes_line(skips, decision.positions, traits(config.schedule).mirrored))

    return describe


def build_pipeline(module: nn.Module, split: ModuleSplit, topology: Topology, scaler: Any) -> StagePipeline:
    """This rank's pipeline (:func:`~lightning_pipe.assembly.split.pipeline_for`), its refusals as Lightning's
    configuration error; each boundary's crossing values told once, by the rank that holds it."""
    with as_misconfiguration():
        pipeline = pipeline_for(module, split, topology, scaler)
    placement = split.placement
    mirrored, stages = traits(split.config.schedule).mirrored, len(placement.positions)
    for stage, runner in pipeline.runners.items():
        if tells_crossing(stage, stages, placement.replica, mirrored):
            runner.tell = rank_info(placement.rank)
    return pipeline


def for_this_world(config: PipelineConfig, world_size: int, replicas: int | None = None) -> PipelineConfig:
    """``config`` for the world of an elastic run's restart: without the per-process arguments
    (``rank_speeds``, ``rank_order``) that name another number of processes (the ranks' speeds are
    then measured and place them, as without those arguments; a warning says so), and under
    ``replicas_sync="allreduce"`` where elastic averaging is left with one replica of each stage
    (``replicas``: the layout's; the restart's report says so)."""
    if config.elastic is False:
        return config
    given = {name: getattr(config, name) for name in ("rank_speeds", "rank_order")}
    stale = [name for name, values in given.items() if values is not None and len(values) != world_size]
    for name in stale:
        log.warning(
            "lightning-pipe elastic: %s names %d processes and the run restarted on %d: the ranks' speeds are "
            "measured instead.", name, len(given[name]), world_size,
        )  # fmt: skip
    changes: dict[str, Any] = dict.fromkeys(stale)
    sync = restart_replicas_sync(config.replicas_sync, replicas or 0, restart_count() > 0)
    if sync != config.replicas_sync:
        changes.update(replicas_sync=sync, replicas_sync_period=None, replicas_sync_alpha=None)
    return config.replace(**changes) if changes else config


def measure_inputs(
    module: Any,
    to_device: Callable[[Any, torch.device], Any],
    device: torch.device,
    is_source: bool,
    broadcast: Callable[[Any], Any],
    context: Callable[[], AbstractContextManager[Any]],
) -> MeasureInputs:
    """What profiling before the split needs: the run's first batch (drawn when first asked for,
    moved by ``to_device`` to the device the module's tensors are on), this rank's device, whether
    its numbers decide, the broadcast and the precision's training context."""

    def batch() -> Any:
        home = next((t.device for t in module.state_dict().values()), torch.device("cpu"))
        return to_device(first_batch(module.trainer), home)

    return MeasureInputs(
        batch, device, is_source, broadcast, context, lambda: configured_optimizers(module), gather_objects()
    )
