"""Every ``PipelineStrategy`` argument as one frozen value, checked once where the user wrote it.

The strategy, the planner and the pipeline read the same :class:`PipelineConfig`; nothing
changes it in place. ``plan="auto"`` gets a new one from the planner (``dataclasses.replace``),
so the values a run uses are always the ones that were checked, and no module below the
strategy needs the strategy object to learn or to change them.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from lightning_pipe.partition.placement import check_rank_order
from lightning_pipe.partition.speeds import check_rank_speeds
from lightning_pipe.partition.split import BALANCE_MODES, BalanceSpec
from lightning_pipe.runtime.elastic_average import check_replicas_sync
from lightning_pipe.runtime.loss_weights import LossWeight, check_loss_weight
from lightning_pipe.runtime.stage import CHECKPOINT_MODES
from lightning_pipe.runtime.topology import check_layout_arguments
from lightning_pipe.runtime.xpipe import PREDICTORS
from lightning_pipe.schedules import check_virtual_stages, get_schedule, traits
from lightning_pipe.weights import check_weights_argument
from lightning_pipe.weights.names import Rename, check_rename

PLANS = (None, "auto")
START_METHODS = ("popen", "spawn", "fork", "forkserver")


@dataclass(frozen=True)
class PipelineConfig:
    """The arguments of a pipeline run (names and meanings as ``PipelineStrategy``'s).

    Attributes:
        schedule: micro-batch order: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"``
            (ZB-H1: each backward split into the input gradient and, later, the weight gradient),
            ``"interleaved_zero_bubble"``, ``"zbv"``, ``"dualpipev"`` (ZB-V's V with DeepSeek's F&B pairs;
            chunks >= 2 x processes), ``"chimera"`` (two pipelines in opposite
            directions, each stage kept twice), or an asynchronous one (``"pipedream"``,
            ``"pipedream_2bw"``, ``"pipemare"``, ``"xpipe"``, ``"wpipe"``), or your own schedule as text: the
            path of a ``.csv`` or ``.txt`` file, or the text itself (a string with a newline or a comma), one line
            of actions per rank (see :mod:`lightning_pipe.schedules.text`). A text schedule is synchronous,
            validated here; its stages per rank and micro-batches are the text's (``chunks`` must agree).
        chunks: micro-batches per batch (None: twice the number of stages). A batch smaller than
            ``chunks`` is split into as many micro-batches as it has samples.
        balance: how layers are assigned to stages: ``"uniform"`` (equal layer counts),
            ``"parameters"`` (equal parameter counts), ``"time"`` / ``"memory"`` (the least slowest /
            largest stage, from a profile measured on the device before the split, identical on every
            rank; kept in ``strategy.profile``) or a list of layer counts per stage.
        recompute: activation recomputation: ``"always"``, ``"except_last"`` (every micro-batch but
            the last) or ``"never"``.
        module: what to split: the name or dotted path of an ``nn.Sequential`` that the model calls
            (needed when the module has several top-level ones), or the dotted path of an
            ``nn.ModuleList`` of blocks that the model's ``forward`` loops over, the model unchanged
            (``"model.transformer.h"``; see :mod:`lightning_pipe.runtime.blocks`).
        init: for a module built on the meta device, ``init(module)`` initialises one module's own
            tensors, called on every module, children before parents, seeded per layer (default: a
            Hugging Face ``PreTrainedModel``'s own ``_init_weights``, else ``reset_parameters()``;
            see :mod:`lightning_pipe.partition.materialize`).
        rename: for ``weights``: a mapping of file-name prefixes to module-name prefixes, or a
            callable file name -> module name (None leaves a tensor out), where the file's names
            differ from the module's by more than one common prefix (see :mod:`lightning_pipe.weights.names`).
        gradient_accumulation_fusion: in training steps, the backward of each plain ``nn.Linear``
            adds its weight gradient into ``.grad`` within the matrix product instead of computing
            each micro-batch's gradient apart and adding it (same gradients, less memory traffic;
            see :mod:`lightning_pipe.runtime.fused_linear`).
        virtual_stages: stages per process for ``"interleaved_1f1b"`` and ``"interleaved_zero_bubble"``
            (>= 2, default 2), ``"zbv"`` and ``"dualpipev"`` (2); the layers are split into processes x virtual_stages
            stages by ``balance``. None becomes the schedule's default here, so a ``replace`` that
            changes the schedule must give its ``virtual_stages`` too.
        check_data: when the stages compare a checksum of the batch they loaded (they compare its
            shapes every step): ``True`` every step, an integer ``N`` every ``N`` steps and at the
            first step of each epoch and evaluation loop, ``False`` never (see
            :mod:`lightning_pipe.runtime.agreement`).
        weights: full weights to start from (``.pt``/``.pth`` state_dict, Lightning ``.ckpt``,
            ``.safetensors``, a ``save_pretrained`` directory or a lightning-pipe checkpoint
            directory); each rank reads only its
            stage's tensors (see :mod:`lightning_pipe.weights`).
        plan: ``"auto"`` to let the planner choose ``schedule`` (among the synchronous ones),
            ``virtual_stages``, ``chunks``, ``balance`` and ``recompute`` from a profile of the layers
            and the measured point-to-point link, before the split (see :mod:`lightning_pipe.plan.planner`);
            ``stages`` (and so the replicas) stays as given. None: as given.
        stages: pipeline depth p (None: one stage per process). The world (devices x nodes) must be
            p x d: d replicas of the pipeline train together, each on its own part of every step.
        data_parallel: how the replicas of a stage share it: ``"replicate"`` (whole copies, gradients
            averaged over the replicas) or ``"shard"`` (FSDP2 over the replicas).
        start_method: how processes start, as in ``DDPStrategy``: ``"popen"`` (scripts and the CLI),
            ``"spawn"`` or ``"fork"`` (notebooks and tests).
        plan_all_layouts: with ``plan="auto"``, rank every stages x replicas of the world too
            (``lightning-pipe plan`` prints them; the run keeps its own layout).
        pipemare_warmup: PipeMare's learning-rate rescheduling for the asynchronous schedules: stage
            ``i`` steps with ``lr * tau_i ** -(1 - min(k / K, 1))`` at update ``k``, back to the user's
            ``lr`` after ``K = pipemare_warmup`` updates (``tau_i``: the stage's update delay). None:
            1000 under ``"pipemare"``, off under ``"pipedream"``/``"pipedream_2bw"``; 0: off (see
            :mod:`lightning_pipe.runtime.pipemare`).
        pipemare_correction: PipeMare's discrepancy correction: each backward runs on the weights
            predicted for its forward's moment from a velocity of the updates. None or True: on under
            ``"pipemare"`` (it needs ``recompute="never"``); False: backwards on the current weights
            (under activation checkpointing, the recomputed activations too).
        pipemare_decay: ``D`` in the correction's velocity decay ``gamma_i = D ** (1 / tau_i)``, in
            (0, 1): how much of the velocity is left after one delay of ``tau_i`` updates. None: 0.1
            (:data:`lightning_pipe.runtime.pipemare.DEFAULT_DECAY`). Larger values average the
            updates over more steps.
        xpipe_predictor: how ``schedule="xpipe"`` predicts the weights its forwards and backwards
            run on, ``s`` updates ahead: ``"update"`` (the optimizer's last update times ``s``; any
            optimizer), ``"adam"`` (from Adam's moments) or ``"momentum"`` (from SGD's momentum
            buffer). None: ``"update"`` (see :mod:`lightning_pipe.runtime.xpipe`).
        loss_weight: how many items each micro-batch's loss averages over, ``loss_weight(micro_batch)
            -> number``: each micro-batch's loss (and each mean it logs) is weighted by its share of
            the batch's count, so the gradient is the batch's mean over those items. None or
            ``"samples"``: the micro-batch's size. Language models whose loss is a mean over the valid
            tokens give :func:`lightning_pipe.token_count` (see :mod:`lightning_pipe.runtime.loss_weights`).
        elastic: resume by itself after torchrun's elastic agent restarts the run (a lost node): ``True``
            watches the ``ModelCheckpoint`` callbacks' ``dirpath``, a path watches that folder; each
            (re)start resumes from the newest complete checkpoint there, under the layout that fits the
            new world, keeping the global batch (see :mod:`lightning_pipe.trainer.elastic`). False: off.
        replicas_sync: how the replicas of a stage (``data_parallel="replicate"``) stay together:
            ``"allreduce"`` (their gradients averaged every step: they train as one model on the global
            batch) or ``"elastic"`` (AvgPipe's elastic averaging: each steps on its own batches, and every
            ``replicas_sync_period`` steps replicas and a center variable pull towards each other by
            ``replicas_sync_alpha``; see :mod:`lightning_pipe.runtime.elastic_average`).
        replicas_sync_period: optimizer steps between two elastic averagings (None: 4).
        replicas_sync_alpha: the elastic coefficient, in (0, 1), with replicas x alpha <= 1 (None: 0.9 / replicas).
        rank_speeds: for ``balance="time"`` and ``plan="auto"`` on unequal devices: one relative speed per
            process, global rank 0 first (``[1.0, 0.5]``: rank 1 runs at half the speed of rank 0); each
            stage's measured seconds are divided by its rank's speed, so a slower rank gets less work.
            None: every rank times a fixed probe on its own device before the split (see
            :mod:`lightning_pipe.partition.speeds`).
        rank_order: which global rank holds which pipeline position: the ranks of stage 0's replicas
            first, then stage 1's (``[0, 2, 1, 3]`` on 2 stages x 2 replicas: ranks 0 and 2 hold stage
            0). None: chosen from the ranks' speeds (``balance="time"``, ``plan="auto"``) or free memory
            (``balance="memory"``) where they differ, so that a stage's replicas are equally fast;
            otherwise rank ``r`` holds stage ``r // replicas`` (see :mod:`lightning_pipe.partition.placement`).
    """

    schedule: str = "1f1b"
    chunks: int | None = None
    balance: BalanceSpec = "uniform"
    recompute: str = "never"
    module: str | None = None
    init: Callable[[nn.Module], None] | None = None
    rename: Rename | None = None
    gradient_accumulation_fusion: bool = True
    virtual_stages: int | None = None
    check_data: bool | int = True
    weights: str | Path | None = None
    plan: str | None = None
    stages: int | None = None
    data_parallel: str = "replicate"
    start_method: str = "popen"
    plan_all_layouts: bool = False
    pipemare_warmup: int | None = None
    pipemare_correction: bool | None = None
    pipemare_decay: float | None = None
    xpipe_predictor: str | None = None
    loss_weight: LossWeight | str | None = None
    elastic: bool | str | Path = False
    replicas_sync: str = "allreduce"
    replicas_sync_period: int | None = None
    replicas_sync_alpha: float | None = None
    rank_speeds: Sequence[float] | None = None
    rank_order: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.schedule, os.PathLike):  # a schedule text's path
            object.__setattr__(self, "schedule", os.fspath(self.schedule))
        check_arguments(self)
        object.__setattr__(self, "rank_order", check_rank_order(self.rank_order))  # numpy's integers as Python's
        if self.loss_weight == "samples":
            object.__setattr__(self, "loss_weight", None)
        if self.virtual_stages is None:
            object.__setattr__(self, "virtual_stages", traits(self.schedule).virtual_stages)

    @property
    def checkpoint(self) -> str:
        """The former name of :attr:`recompute` (activation recomputation), kept for reading."""
        return self.recompute

    def replace(self, **changes: Any) -> PipelineConfig:
        """A copy with ``changes``, checked like the original."""
        return dataclasses.replace(self, **changes)

    def num_microbatches(self, num_stages: int) -> int:
        """Micro-batches per batch for a pipeline of ``num_stages``: ``chunks``, or a schedule text's
        count, or twice the stages."""
        if self.chunks is not None:
            return self.chunks
        text = traits(self.schedule).text
        return text.num_microbatches if text is not None else 2 * num_stages


def recompute_mode(recompute: str | None, checkpoint: str | None) -> str:
    """``recompute=``, or its former name ``checkpoint=`` with a ``DeprecationWarning`` (the name
    collided with saved checkpoints); ``"never"`` when neither is given."""
    if checkpoint is None:
        return "never" if recompute is None else recompute
    if recompute is not None and recompute != checkpoint:
        raise ValueError(
            f"PipelineStrategy(recompute={recompute!r}, checkpoint={checkpoint!r}): both name activation "
            "recomputation; give recompute= only (checkpoint= is its deprecated former name)."
        )
    warnings.warn(
        f"PipelineStrategy(checkpoint={checkpoint!r}) is deprecated: write recompute={checkpoint!r} (activation "
        "recomputation; checkpoint= will be removed in a later release).",
        DeprecationWarning,
        stacklevel=3,
    )
    return checkpoint


def check_arguments(config: PipelineConfig) -> None:
    """Reject bad ``PipelineStrategy`` arguments, naming the valid values."""
    schedule, chunks, balance, recompute = config.schedule, config.chunks, config.balance, config.recompute
    get_schedule(schedule)
    check_text_schedule(config)
    check_weights_argument(config.weights)
    check_rename(config.rename)
    if config.init is not None and not callable(config.init):
        raise TypeError(
            f"PipelineStrategy(init={config.init!r}): give a callable init(module) -> None that sets the module's own "
            "tensors."
        )
    check_layout_arguments(config.stages, config.data_parallel)
    if config.virtual_stages is not None:
        check_virtual_stages(schedule, config.virtual_stages)
    if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise ValueError(
            f"PipelineStrategy(chunks={chunks!r}): chunks is the number of micro-batches per batch and must be an "
            "integer >= 1."
        )
    if isinstance(balance, str):
        if balance not in BALANCE_MODES:
            raise ValueError(
                f"PipelineStrategy(balance={balance!r}): unknown balance. Valid: {', '.join(BALANCE_MODES)}, "
                "or a list of layer counts per stage."
            )
    elif not isinstance(balance, (list, tuple)) or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in balance
    ):
        raise ValueError(
            f"PipelineStrategy(balance={balance!r}): give one of {', '.join(BALANCE_MODES)}, or a list of layer counts "
            "per stage."
        )
    if recompute not in CHECKPOINT_MODES:
        raise ValueError(
            f"PipelineStrategy(recompute={recompute!r}): unknown mode. Valid: {', '.join(CHECKPOINT_MODES)}."
        )
    if config.plan not in PLANS:
        raise ValueError(
            f"PipelineStrategy(plan={config.plan!r}): valid values are None (use the arguments as given) and 'auto'."
        )
    check_data = config.check_data
    if not isinstance(check_data, int) or (not isinstance(check_data, bool) and check_data < 1):
        raise ValueError(
            f"PipelineStrategy(check_data={check_data!r}): give True (compare a checksum of the stages' batches "
            "every step), an integer N >= 1 (every N steps and the first of each epoch) or False (shapes only)."
        )
    check_pipemare_options(config)
    check_elastic_averaging(config)
    check_rank_speeds(config.rank_speeds)
    check_rank_order(config.rank_order)
    if config.rank_speeds is not None and balance != "time" and config.plan != "auto":
        raise ValueError(
            f"PipelineStrategy(rank_speeds={config.rank_speeds!r}, balance={balance!r}): the speeds weight the "
            "measured split, balance='time' (or plan='auto'). Give balance='time', or leave rank_speeds unset."
        )
    check_loss_weight(config.loss_weight)
    if not isinstance(config.elastic, (bool, str, Path)) or config.elastic == "":
        raise ValueError(
            f"PipelineStrategy(elastic={config.elastic!r}): give True (watch the ModelCheckpoint callbacks' dirpath), "
            "the folder of the checkpoints to resume from, or False (off)."
        )
    if config.start_method not in START_METHODS:
        raise ValueError(
            f"PipelineStrategy(start_method={config.start_method!r}): valid values are {', '.join(START_METHODS)}."
        )


def check_text_schedule(config: PipelineConfig) -> None:
    """A schedule handed in as text fixes the micro-batches and the schedule: ``chunks`` must agree,
    and the planner, which chooses a schedule, cannot run it."""
    text = traits(config.schedule).text
    if text is None:
        return
    if config.chunks is not None and config.chunks != text.num_microbatches:
        raise ValueError(
            f"PipelineStrategy(chunks={config.chunks}): the schedule text {text.name!r} runs "
            f"{text.num_microbatches} micro-batches per batch. Give chunks={text.num_microbatches} or leave it unset."
        )
    if config.plan is not None:
        raise ValueError(
            f"PipelineStrategy(plan={config.plan!r}) chooses the schedule, and schedule= hands one in as text "
            f"({text.name!r}). Leave plan unset to run the text, or give a schedule's name to plan."
        )


def check_elastic_averaging(config: PipelineConfig) -> None:
    """``replicas_sync="elastic"``: whole replicas that each step on their own, synchronously (the
    layout's replica count is checked once known, in :func:`~lightning_pipe.runtime.elastic_average.resolve_alpha`)."""
    check_replicas_sync(config.replicas_sync, config.replicas_sync_period, config.replicas_sync_alpha)
    if config.replicas_sync != "elastic":
        return
    if config.data_parallel != "replicate":
        raise ValueError(
            f"PipelineStrategy(replicas_sync='elastic', data_parallel={config.data_parallel!r}): elastic averaging "
            "pulls whole replicas of each stage together, and sharded replicas hold parts of one. Use "
            "data_parallel='replicate', or replicas_sync='allreduce'."
        )
    if traits(config.schedule).asynchronous:
        raise ValueError(
            f"PipelineStrategy(replicas_sync='elastic', schedule={config.schedule!r}): elastic averaging runs with "
            "the synchronous schedules; an asynchronous one keeps weight versions that the averaging would not "
            "update. Use a synchronous schedule (such as '1f1b' or 'gpipe'), or replicas_sync='allreduce'."
        )


def check_pipemare_options(config: PipelineConfig) -> None:
    """PipeMare's switches: rescheduling for the asynchronous schedules, correction for ``pipemare``;
    XPipe's predictor."""
    warmup, correction, schedule = config.pipemare_warmup, config.pipemare_correction, config.schedule
    if warmup is not None:
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(
                f"PipelineStrategy(pipemare_warmup={warmup!r}): give the number of optimizer updates K >= 0 over which "
                "the learning-rate rescheduling returns to your learning rate (0: off, None: the schedule's default)."
            )
        if warmup > 0 and not traits(schedule).asynchronous:
            raise ValueError(
                f"PipelineStrategy(pipemare_warmup={warmup}) rescales the step size of asynchronous schedules, whose "
                f"gradients arrive late; schedule={schedule!r} is synchronous. Use schedule='pipemare', 'pipedream' "
                "or 'pipedream_2bw', or leave pipemare_warmup unset."
            )
    if correction is not None and not isinstance(correction, bool):
        raise ValueError(f"PipelineStrategy(pipemare_correction={correction!r}): give True, False or None.")
    if correction and not traits(schedule).predicts_weights:
        raise ValueError(
            f"PipelineStrategy(pipemare_correction=True) predicts the forward's weights for backwards that run on "
            f"newer ones; schedule={schedule!r} "
            + (
                "keeps the forward's weights for its backwards already"
                if traits(schedule).stashes_weights
                else "predicts its forwards' and backwards' weights ahead already"
                if traits(schedule).predicts_ahead
                else "has no such backwards"
            )
            + ". Use schedule='pipemare', or leave pipemare_correction unset."
        )
    decay = config.pipemare_decay
    if decay is not None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
            raise ValueError(
                f"PipelineStrategy(pipemare_decay={decay!r}): give the velocity's decay over one delay, a number "
                "strictly between 0 and 1 (None: 0.1)."
            )
        if not traits(schedule).predicts_weights or correction is False:
            raise ValueError(
                f"PipelineStrategy(pipemare_decay={decay}) sets the velocity of PipeMare's discrepancy correction, "
                f"which is off here (schedule={schedule!r}, pipemare_correction={correction!r}). Use "
                "schedule='pipemare' with the correction on, or leave pipemare_decay unset."
            )
    predictor = config.xpipe_predictor
    if predictor is not None and (predictor not in PREDICTORS or not traits(schedule).predicts_ahead):
        raise ValueError(
            f"PipelineStrategy(xpipe_predictor={predictor!r}) sets how schedule='xpipe' predicts its weights"
            + (
                f"; valid: {', '.join(PREDICTORS)}"
                if predictor not in PREDICTORS
                else f"; schedule={schedule!r} does not"
            )
            + ". Use schedule='xpipe' with one of those, or leave xpipe_predictor unset."
        )
    if traits(schedule).predicts_ahead and config.recompute != "never":
        raise ValueError(
            f"PipelineStrategy(schedule={schedule!r}, recompute={config.recompute!r}): each forward runs on weights "
            "predicted when its step starts, but a recomputed forward would read a later prediction. Use "
            "recompute='never'."
        )
    if traits(schedule).predicts_weights and correction is not False and config.recompute != "never":
        raise ValueError(
            f"PipelineStrategy(schedule='pipemare', recompute={config.recompute!r}): discrepancy correction gives each "
            "backward the weights predicted for its forward, but a recomputed forward reads the current ones. Use "
            "recompute='never', or pipemare_correction=False."
        )


__all__ = [
    "PLANS",
    "START_METHODS",
    "PipelineConfig",
    "check_arguments",
    "check_elastic_averaging",
    "check_pipemare_options",
    "recompute_mode",
]
