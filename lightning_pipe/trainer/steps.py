"""From a Lightning batch to the pipeline's verbs, and back to what Lightning expects of a step.

Lightning calls ``training_step`` (or an evaluation step) once per batch with the batch and its
index. :class:`PipelineSteps` splits the batch into micro-batches, has the stages start agreeing
on what they loaded, wraps the user's step method into the per-micro-batch step function the
:class:`~lightning_pipe.runtime.pipeline.StagePipeline` runs, and turns what the last stage's
steps returned and logged into one loss and one set of logged means per batch, on every rank
(:mod:`lightning_pipe.trainer.step_results`). Asynchronous schedules share a step's summary a step late,
so that no rank waits for the others between steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_pipe.config import PipelineConfig
from lightning_pipe.runtime.asynchronous.rising_loss import RisingLoss
from lightning_pipe.runtime.blocks.reads import refuse_held
from lightning_pipe.runtime.loss_weights import LossWeight, microbatch_shares
from lightning_pipe.runtime.microbatch import batch_size, merge, signature, split, tensors_of
from lightning_pipe.runtime.model_losses import (
    default_loss_weight,
    padding_warning,
    per_forward_loss_line,
    token_mean_shift,
)
from lightning_pipe.runtime.pipeline import Context, StagePipeline
from lightning_pipe.runtime.topology import Topology
from lightning_pipe.trainer.compatibility import as_misconfiguration, check_async_accumulation
from lightning_pipe.trainer.dataloaders.loaders import is_padding
from lightning_pipe.trainer.dataloaders.replica_data import EMPTY, combine_over_replicas
from lightning_pipe.trainer.step_results import StepRecorder, SummarySharing, gather_recorders, replay, step_loss

_LOADERS = {  # step kind -> (name in messages, Trainer attribute holding its DataLoader)
    "train": ("training", "train_dataloader"),
    "validation_step": ("validation", "val_dataloaders"),
    "test_step": ("test", "test_dataloaders"),
    "predict_step": ("predict", "predict_dataloaders"),
}


class PipelineSteps:
    """The Lightning side of this rank's steps.

    Args:
        pipeline: this rank's pipeline.
        config: the run's arguments (``check_data``, ``loss_weight``, the schedule named in messages).
        topology: its process groups (the replicas' group for combined summaries, the pipeline's
            gloo group for summaries and predictions).
        module: the user's LightningModule, whose step methods run.
        precision: the Trainer's precision plugin: each kind of step's context, and the gradient
            scaler (``16-mixed``) that scales each micro-batch's loss.
        stop_if_requested: called before each step (stops every stage at the same step after a
            SIGTERM); None: nothing to check.
    """

    def __init__(
        self,
        pipeline: StagePipeline,
        config: PipelineConfig,
        topology: Topology,
        module: pl.LightningModule,
        precision: Precision,
        stop_if_requested: Callable[[], None] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.placement = pipeline.placement
        self.config = config
        self.module = module
        self._dp_group = topology.dp_group
        self._meta_group = topology.meta_group
        self._precision = precision
        self._contexts: dict[str, Context] = {
            "validation_step": precision.val_step_context,
            "test_step": precision.test_step_context,
            "predict_step": precision.predict_step_context,
        }
        self._scaler = getattr(precision, "scaler", None)
        self._stop_if_requested = stop_if_requested or (lambda: None)
        self._sharing: SummarySharing | None = None  # the last stage's summaries, on every rank
        self._last_loss = float("nan")
        self._pending_loss: float | None = None  # asynchronous: a drained batch's loss, the next step returns it
        self._warned_drain = False  # asynchronous: a drain that changes the weights was told once
        # the default loss weight: a Hugging Face model's token-mean loss, read once from the model
        self._token_mean_shift = token_mean_shift(module) if config.loss_weight is None else None
        self._warned_padding = config.loss_weight is not None or self.placement.rank != 0
        self._told_per_forward = self.placement.rank != 0  # a per-forward loss (MoE load balancing), told once
        self._rising: RisingLoss | None = None  # a delay correction's early loss, watched on rank 0

    @property
    def device(self) -> torch.device:
        return self.placement.device

    # ------------------------------------------------------------------ training
    def training_step(self, args: tuple, kwargs: dict) -> Tensor:
        """One batch through the training schedule; the mean loss over its micro-batches."""
        self._stop_if_requested()  # after a SIGTERM, every stage stops here at the same step
        context = self._precision.train_step_context
        module, micro, keys, weights, recorder = self.begin_step(self.module, "train", args)
        rest = args[1:]
        with as_misconfiguration():
            ends = self.pipeline.ends_here(len(micro))  # where each micro-batch's loss is computed

        def step(i: int) -> Tensor | None:
            weight, keep = weights[i], ends[i]
            with recorder.capture(module, weight, keep):
                output = module.training_step(micro[i], *rest, **kwargs)
            if not keep:
                return None
            loss = step_loss(output)
            if loss is None:
                raise RuntimeError(
                    "training_step returned None for a micro-batch. Under the pipeline every micro-batch must "
                    "return its loss; skipping a batch is not supported."
                )
            if weight > 0 and torch.is_anomaly_enabled() and not bool(torch.isfinite(loss.detach()).all()):
                raise FloatingPointError(
                    f"training_step returned a loss of {loss.detach().float().item()} for micro-batch {i} of "
                    f"{len(micro)} (batch {rest[0] if rest else '?'}, global step {module.trainer.global_step}) on "
                    f"{self.placement.describe_rank(self.placement.rank)}; stopping because "
                    "Trainer(detect_anomaly=True)."
                )
            recorder.add_loss(loss, weight)
            scaled = loss * weight
            return self._scaler.scale(scaled) if self._scaler is not None else scaled

        if self.pipeline.asynchronous is not None:
            return self._async_training_step(module, keys, recorder, step, context, rest[0] if rest else 0)
        with as_misconfiguration():
            self.pipeline.train_step(keys, step, context)
        losses_at = self.pipeline.loss_ranks(len(micro))
        if len(losses_at) > 1:  # Chimera: the down pipeline's results join the up pipeline's first
            self.finish_pending()
            gather_recorders(recorder, losses_at, self.placement.rank, self._meta_group)
        summary = self.share("train", recorder)
        replay(module, summary, self.device)
        recorder.log_local(module)
        return torch.tensor(summary["loss"], device=self.device)

    def _async_training_step(
        self,
        module: pl.LightningModule,
        keys: list,
        recorder: StepRecorder,
        step: Callable,
        context: Context,
        batch_idx: int,
    ) -> Tensor:
        """One step of an asynchronous schedule: this batch's forwards and the backwards due now;
        the gradient applied by this step's optimizer update is that of an earlier batch."""
        trainer = module.trainer
        check_async_accumulation(self.config.schedule, trainer.accumulate_grad_batches)  # changed by a callback
        with as_misconfiguration():
            epoch_end, stop = self._async_pauses(trainer, batch_idx)
            sync = self.pipeline.train_step(keys, step, context, pause_after=epoch_end, stop_after=stop)
        # Logged values reach the other ranks a step late, so that no rank waits between steps;
        # where the pipeline starts or drains anyway, they are shared at once.
        summary = self.summary(recorder) if self.placement.is_last_stage else None
        if self.placement.num_stages == 1:
            assert summary is not None
            self._replay_summary(module, summary)
        else:  # the step returns the previous batch's loss, at drains too: every batch's once, in order
            returned, self._pending_loss = self._pending_loss, None
            lagged = self._summaries().take_lagged()
            if lagged is not None:
                self._replay_summary(module, lagged)
                returned = self._last_loss
            if sync:
                self._replay_summary(module, self._summaries().share("train", summary))
                self._pending_loss = self._last_loss
            else:
                self._summaries().post_lagged(summary)
            self._last_loss = float("nan") if returned is None else returned  # nan: no batch before the first
        self._watch_correction(trainer)
        recorder.log_local(module)
        return torch.tensor(self._last_loss, device=self.device)

    def _watch_correction(self, trainer: pl.Trainer) -> None:
        """A delay correction's loss rising early is told once (:class:`RisingLoss`), on rank 0, which has every
        batch's loss."""
        if self.config.delay_correction is None or self.placement.rank != 0:
            return
        if self._rising is None:
            self._rising = RisingLoss(self.config.delay_correction, float(trainer.estimated_stepping_batches))
        if (said := self._rising.observe(trainer.global_step, self._last_loss)) is not None:
            rank_zero_warn(said)

    def _replay_summary(self, module: pl.LightningModule, summary: dict[str, Any]) -> None:
        replay(module, summary, self.device)
        if summary["loss"] is not None:
            self._last_loss = summary["loss"]

    @staticmethod
    def _async_pauses(trainer: pl.Trainer, batch_idx: int) -> tuple[bool, bool]:
        """Whether an epoch ends after this step (the rule drains before its update), and whether
        training stops after it in the middle of an epoch (``max_steps``: drained after the update)."""
        loop = trainer.fit_loop.epoch_loop
        epoch_end = loop.batch_progress.is_last_batch or batch_idx + 1 >= trainer.num_training_batches
        return epoch_end, not epoch_end and 0 < trainer.max_steps <= trainer.global_step + 1

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, hook: str, args: tuple, kwargs: dict) -> Any:
        """Forward-only pipeline of one evaluation batch; the hook runs on the last stage once per
        micro-batch. Returns the merged outputs on the last stage, None elsewhere."""
        self._stop_if_requested()
        module, context = self.module, self._contexts[hook]
        # a replica without samples left joins the others' summary with none; sharded stages still run
        # the forward (its parameter all-gathers are collectives over the replicas), counting nothing
        padding = self._padding_step(module, hook, args)
        if padding and self.pipeline.shards is None:
            replay(module, self.share(hook, None, samples=0), self.device)
            return None
        module, micro, keys, weights, recorder = self.begin_step(module, hook, args)
        rest, keep = args[1:], self.placement.is_last_stage and not padding
        outputs: list[Any] = [None] * len(micro)

        def step(i: int) -> None:
            with recorder.capture(module, weights[i], keep):
                output = getattr(module, hook)(micro[i], *rest, **kwargs)
            refuse_held(output, f"What {hook} returned")  # a block container's read of another stage's block
            outputs[i] = output
            return None

        with as_misconfiguration():
            self.pipeline.evaluate(keys, step, context)
        samples = 0 if padding else sum(batch_size(mb) for mb in micro)
        summary = self.share(hook, None if padding else recorder, samples)
        replay(module, summary, self.device)
        recorder.log_local(module)
        return merge(outputs) if keep else None

    def _padding_step(self, module: pl.LightningModule, hook: str, args: tuple) -> bool:
        """Whether this evaluation step only keeps this replica in step with replicas that have more
        samples (see :class:`lightning_pipe.trainer.dataloaders.replica_data.EvaluationShare`)."""
        if self.placement.num_replicas == 1 or hook == "predict_step" or module is None:
            return False
        batch_idx = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
        dataloader_idx = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        return is_padding(module.trainer, batch_idx, dataloader_idx)

    def predict_step(self, args: tuple, kwargs: dict) -> Any:
        """Outputs of the batch's micro-batches, merged, on global rank 0 (None on other ranks)."""
        outputs = self.evaluate("predict_step", args, kwargs)
        placement = self.placement
        if placement.num_stages == 1:
            return outputs if placement.rank == 0 else None
        box = [outputs]
        self.finish_pending()
        ranks = placement.pipeline_ranks
        last = ranks[placement.last_position]
        if 0 in ranks and last != 0:  # rank 0's pipeline's outputs go to rank 0 (each replica predicts every sample)
            if placement.is_last_stage:
                dist.send_object_list(box, dst=0, group=self._meta_group)
            elif placement.rank == 0:
                dist.recv_object_list(box, src=last, group=self._meta_group)
        return box[0] if placement.rank == 0 else None

    # ------------------------------------------------------------------ a step's batch
    def begin_step(
        self, module: pl.LightningModule, kind: str, args: tuple
    ) -> tuple[pl.LightningModule, list[Any], list[tuple], list[float], StepRecorder]:
        """The module, the batch's micro-batches, their shape keys, their weights (share of the
        batch's samples, or of what ``loss_weight`` counts) and a recorder for what the step logs.
        Starts checking that every stage
        loaded the same batch (finished before this rank's first receive)."""
        assert module is not None
        batch = args[0]
        micro = split(batch, self.pipeline.microbatches_for(batch_size(batch)))
        keys = [signature(mb) for mb in micro]
        if self.pipeline.agreement is not None:
            batch_idx = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
            loader_idx = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            if self._checks_values(batch_idx):
                trainer = module.trainer
                at = (trainer.current_epoch, trainer.global_step) if kind == "train" else None  # as the step began
                every = self.config.check_data
                source = lambda: _data_source(module, kind, batch_idx, loader_idx, at, every)  # noqa: E731 - named only on a mismatch
                self.pipeline.agree(keys, tensors_of(batch), source)
            else:
                self.pipeline.agree(keys)
        # each micro-batch's share of the batch's loss (see runtime.loss_weights); a custom count is taken
        # only where losses and logs are recorded (it may read the batch back from the device)
        counted = self.placement.is_last_stage or (
            kind == "train" and self.placement.rank in self.pipeline.loss_ranks(len(micro))
        )
        loss_weight = self._loss_weight(kind, batch, micro)
        weights, items = microbatch_shares(micro, loss_weight if counted else None)
        return module, micro, keys, weights, StepRecorder(items)

    def _loss_weight(self, kind: str, batch: Any, micro: list[Any]) -> LossWeight | None:
        """The run's ``loss_weight`` (None: the samples), or where it is unset, the default for this batch: a
        Hugging Face model's token-mean loss fed a dict batch with ``labels`` counts its valid labels; else the
        samples, and rank 0 warns once at the first training batch where labels with -100 make the two differ
        (:mod:`lightning_pipe.runtime.model_losses`). Rank 0 also tells once that a per-forward loss is one per
        micro-batch."""
        chosen = self.config.loss_weight
        if kind == "train" and not self._told_per_forward:
            self._told_per_forward = True
            line = per_forward_loss_line(self.module)
            if line is not None:
                rank_zero_warn(line)
        if chosen is not None:
            return None if chosen == "samples" else cast("LossWeight", chosen)
        default = default_loss_weight(self._token_mean_shift, batch)
        # only rank 0 warns, so only rank 0 reads the labels back (a device sync per step until it has warned)
        if default is None and kind == "train" and not self._warned_padding and self.module.trainer.is_global_zero:
            why = padding_warning(batch, micro)
            if why is not None:
                self._warned_padding = True
                rank_zero_warn(f"{why} (first at global step {self.module.trainer.global_step})")
        return default

    def _checks_values(self, batch_idx: int) -> bool:
        return checks_values(self.config.check_data, batch_idx)

    # ------------------------------------------------------------------ summaries
    def summary(self, recorder: StepRecorder | None, samples: int | None = None) -> dict[str, Any]:
        """The last stage's step summary (None: a padding step's, empty); with replicas, combined
        over them (the global batch's): in evaluation weighted by each replica's items (its ``samples``,
        or what ``loss_weight`` counts), logged with the global batch's samples."""
        summary = recorder.summary() if recorder is not None else EMPTY
        if self.placement.num_replicas > 1:
            summary = combine_over_replicas(summary, self._dp_group, self.device, samples)
        return summary

    def share(self, kind: str, recorder: StepRecorder | None, samples: int | None = None) -> dict[str, Any]:
        """The last stage's loss and logged means, on every rank (see :class:`SummarySharing`)."""
        summary = self.summary(recorder, samples) if self.placement.is_last_stage else None
        if self.placement.num_stages == 1:
            assert summary is not None
            return summary
        return self._summaries().share(kind, summary)

    def _summaries(self) -> SummarySharing:
        if self._sharing is None:
            placement = self.placement
            src = placement.pipeline_ranks[placement.last_position]
            self._sharing = SummarySharing(src, self._meta_group, placement.is_last_stage)
        return self._sharing

    def finish_pending(self) -> None:
        """Complete this rank's outstanding summary broadcast (before another collective on its group)."""
        if self._sharing is not None:
            self._sharing.finish_pending()

    def finish_in_flight(self) -> None:
        """Before a collective of another kind (evaluation, a checkpoint): this rank's summary
        broadcast, then an asynchronous schedule's work in flight."""
        self.finish_pending()
        why = self.pipeline.inexact_drain()
        if why is not None and not self._warned_drain:
            self._warned_drain = True
            rank_zero_warn(why)
        self.pipeline.drain(self._precision.train_step_context)


def checks_values(check_data: bool | int, batch_idx: int) -> bool:
    """Whether the step of ``batch_idx`` compares a checksum of the batch's values across the
    stages: every step with ``check_data=True`` (the default), every N steps and the first of each
    epoch and loop with ``check_data=N``, never with ``False`` (shapes are compared every step)."""
    return check_data is True or (check_data is not False and (batch_idx == 0 or batch_idx % check_data == 0))


def _data_source(
    module: pl.LightningModule,
    kind: str,
    batch_idx: int,
    loader_idx: int,
    at: tuple[int, int] | None,
    every: bool | int,
) -> str:
    """The DataLoader a step's batch came from and where in it (``at``: the training step's epoch
    and global step), named for an error message (formatted only when the stages disagree)."""
    name, attribute = _LOADERS[kind]
    loader = getattr(module.trainer, attribute, None) if module is not None else None
    if isinstance(loader, (list, tuple)) and loader:
        loader = loader[min(loader_idx, len(loader) - 1)]
    dataset = getattr(loader, "dataset", None)
    where = f"the {name} DataLoader" + (f" (dataset {type(dataset).__name__})" if dataset is not None else "")
    where += f" at batch {batch_idx}"
    if at is not None:
        where += f" of epoch {at[0]} (global step {at[1]})"
    if every is not True and batch_idx > 0:  # check_data=N: the values were last compared N batches ago
        where += f", compared every {every} batches, so they may differ from batch {batch_idx - every + 1} on"
    return where
