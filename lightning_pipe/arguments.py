"""Every keyword of ``PipelineStrategy``, typed, so that editors complete them and type checkers
check them (``PipelineStrategy(**arguments: Unpack[PipelineArguments])``). Written by
``python -m lightning_pipe.config_files`` from :mod:`lightning_pipe.config`'s fields and ``ProcessStrategy``'s
signature: change those, not this file. Their defaults and meanings: :class:`~lightning_pipe.config.PipelineConfig`,
or ``help(PipelineStrategy)``."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TypedDict

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_pipe.config import (
    Correction,
    DataParallelMode,
    PlanMode,
    Predictor,
    ReplicasSyncMode,
    ScheduleName,
    StartMethod,
)
from lightning_pipe.partition.stages.split import BalanceSpec
from lightning_pipe.runtime.activations.policy import OffloadSpec, RecomputeSpec
from lightning_pipe.runtime.loss_weights import LossWeight
from lightning_pipe.weights.names import Rename


class PipelineArguments(TypedDict, total=False):
    """``PipelineStrategy``'s keywords: the pipeline's arguments by their flat names, then the processes'."""

    schedule: ScheduleName
    schedule_text: str | os.PathLike[str] | None
    chunks: int | None
    virtual_stages: int | None
    recompute: RecomputeSpec
    offload: OffloadSpec
    gradient_accumulation_fusion: bool
    loss_weight: LossWeight | str | None
    check_data: bool | int
    module: str | None
    first_stage: Sequence[str] | None
    last_stage: Sequence[str] | None
    balance: BalanceSpec
    plan: PlanMode | None
    memory_budget: int | Sequence[int] | None
    stages: int | None
    data_parallel: DataParallelMode
    rank_speeds: Sequence[float] | None
    rank_order: Sequence[int] | None
    replicas_sync: ReplicasSyncMode
    replicas_sync_period: int | None
    replicas_sync_alpha: float | None
    pipemare_warmup: int | None
    pipemare_correction: bool | None
    pipemare_decay: float | None
    xpipe_predictor: Predictor | None
    delay_correction: Correction | None
    delay_correction_coefficient: float | None
    weights: str | Path | None
    init: Callable[[nn.Module], None] | None
    rename: Rename | None
    start_method: StartMethod
    elastic: bool | str | Path
    accelerator: pl.accelerators.Accelerator | None
    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None
    checkpoint_io: CheckpointIO | None
    precision_plugin: Precision | None
    process_group_backend: str | None
    timeout: timedelta | None
    checkpoint: RecomputeSpec  # deprecated: recompute
