"""What a run's layout allows, checked in setup before the first batch: the combinations of
schedule, sharding, tied weights, parameters outside the Sequential and precision that cannot
train, each refused with the reason and what to change, as Lightning's configuration error (the
schedule a step executes is checked by :mod:`lightning_pipe.schedules.runnable`, whose refusal
:func:`as_misconfiguration` turns into the same error)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_pipe.schedules import is_async, traits
from lightning_pipe.schedules.families.asynchronous import min_chunks
from lightning_pipe.schedules.runnable import ScheduleRefused


@contextmanager
def as_misconfiguration() -> Iterator[None]:
    """A schedule the pipeline refuses (:class:`ScheduleRefused`) reaches the user as Lightning's
    configuration error, as the other checks here do."""
    try:
        yield
    except ScheduleRefused as err:
        raise MisconfigurationException(str(err)) from err.__cause__


def check_automatic_optimization(module: Any) -> None:
    """The strategy runs the backward itself, inside the schedule."""
    if not module.automatic_optimization:
        raise MisconfigurationException(
            "PipelineStrategy runs the backward itself, so it supports automatic optimization only. "
            "Remove `self.automatic_optimization = False` from the LightningModule."
        )


def split_layers(blocks: str | None) -> str:
    """What the split layers are, for a message: ``blocks`` is the ``module=`` path of a block
    container (an ``nn.ModuleList`` the model's forward loops over), None for an ``nn.Sequential``."""
    return "the split nn.Sequential" if blocks is None else f"the blocks of the block container {blocks!r}"


def check_shard(schedule: str, shared: Sequence[nn.Parameter], tied: bool, blocks: str | None = None) -> None:
    """``data_parallel='shard'`` (FSDP2) keeps one weight version. Parameters outside the split layers
    (``shared``; ``blocks``: the ``module=`` path when the split layers are a block container) and
    weights tied across stages are sharded with their stage (:mod:`lightning_pipe.runtime.replicas.sharding`),
    unless the schedule puts both ends of a tie on one process (a V)."""
    if is_async(schedule):
        raise MisconfigurationException(
            f"PipelineStrategy(data_parallel='shard') cannot run here: schedule={schedule!r} keeps weight versions, "
            "which sharded weights do not have. Use data_parallel='replicate' (or a synchronous schedule)."
        )
    if tied and traits(schedule).placement == "v":
        raise MisconfigurationException(
            f"PipelineStrategy(data_parallel='shard') cannot run here: weights are tied across stages, and "
            f"schedule={schedule!r} places the first and last stage on one process, where FSDP2 would shard the tied "
            "weight in two units. Use data_parallel='replicate', or a schedule that places them on different processes "
            "('1f1b', 'zero_bubble', 'interleaved_1f1b')."
        )


def check_elastic_scaler(replicas_sync: str, scaler: Any) -> None:
    """Elastic averaging counts optimizer steps on every replica alike; a gradient scaler skips a step
    where this replica's own gradients overflowed, which the other replicas' need not."""
    if replicas_sync == "elastic" and scaler is not None:
        raise MisconfigurationException(
            "PipelineStrategy(replicas_sync='elastic') with a gradient scaler (precision='16-mixed'): each replica "
            "steps on its own gradients, so one may skip a step that the others take, and their averagings would no "
            "longer match. Use precision='bf16-mixed' or '32-true', or replicas_sync='allreduce'."
        )


def check_chimera_layout(schedule: str, stages: int, replicas: int) -> None:
    """Chimera pairs process ``i`` with process ``stages - 1 - i`` (they hold the same two stages), and
    does not combine with data-parallel replicas of the pipeline."""
    if not traits(schedule).even_stages and traits(schedule).replicas:
        return
    if traits(schedule).even_stages and (stages < 2 or stages % 2):
        raise MisconfigurationException(
            f"schedule='chimera' needs an even number of pipeline stages >= 2 (process i holds stage i of the down "
            f"pipeline and stage {max(stages, 2) - 1}-i of the up one), got {stages}. Use devices (or stages=) 2, 4, "
            "6, ..., or schedule='1f1b'."
        )
    if not traits(schedule).replicas and replicas > 1:
        raise MisconfigurationException(
            f"schedule='chimera' does not combine with data-parallel replicas (stages={stages} on "
            f"{stages * replicas} processes): its two pipelines already hold each stage twice. Run it with stages "
            "equal to the number of processes, or use schedule='1f1b' (or 'zero_bubble') with replicas."
        )


def check_async_accumulation(schedule: str, accumulate_grad_batches: int) -> None:
    """An asynchronous schedule applies one batch's gradient per optimizer step (its delays count steps)."""
    if is_async(schedule) and accumulate_grad_batches != 1:
        raise MisconfigurationException(
            f"schedule={schedule!r} applies one batch's gradient per optimizer step; "
            f"accumulate_grad_batches must be 1, got {accumulate_grad_batches} (raise `chunks` for larger batches "
            "instead)."
        )


def check_async(
    schedule: str,
    module: nn.Module,
    shared: Sequence[nn.Parameter],
    tied: bool,
    stages: int,
    num_microbatches: int,
    scaler: Any,
    blocks: str | None = None,
) -> None:
    """The asynchronous schedules stash (or predict) versions of each stage's weights and apply gradients
    late. Parameters outside the split layers (``shared``: a block container's embeddings, final norm and
    head, whose module is ``module=``'s ``blocks``; a Sequential's pre- and post-processing) take the
    versions of the stage that uses them (:mod:`lightning_pipe.runtime.asynchronous.versions`): nothing to refuse
    there. A weight tied across stages is refused where the stages' delays differ."""
    if tied and traits(schedule).refuses_ties:
        raise MisconfigurationException(
            f"schedule={schedule!r} applies gradients with a different delay on each stage, so the copies of a "
            "weight tied across stages would drift apart. Use schedule='pipedream_2bw' (the same delay on every "
            "stage) or untie the weights."
        )
    needed = min_chunks(schedule, stages)
    if num_microbatches < needed:
        raise MisconfigurationException(
            f"schedule={schedule!r} keeps two weight versions, which needs chunks >= stages - 1; got "
            f"chunks={num_microbatches} with {stages} stages. Use chunks >= {needed} or "
            "schedule='pipedream'. (A shorter last batch of an epoch is fine: it runs drained.)"
        )
    if scaler is not None:
        raise MisconfigurationException(
            f"schedule={schedule!r} applies gradients a step late, when the loss scale of "
            "precision='16-mixed' may have changed. Use precision='bf16-mixed' or a synchronous schedule."
        )


#: The highest rate ``delay_correction="nesterov"`` takes without a word: its step per element is NAdam's, about
#: the rate itself (the reference trains at 3e-4), where an SGD rate of 0.1 would move every weight by 0.1 a step.
NADAM_RATE_BOUND = 1e-2


def check_correction_optimizers(
    correction: str | None, optimizers: Sequence[Any], gradient_clip_val: float | None = None
) -> str | None:
    """Refuse, before training, an optimizer a correction would make diverge; what to tell the user at the start
    otherwise (None: nothing).

    ``"nesterov"`` is NAdam's direction (:mod:`lightning_pipe.runtime.asynchronous.delay_correction`), stepped
    by plain SGD: any optimizer with state of its own (SGD's momentum, Adam's moments) would run a second
    momentum over NAdam's. Its step per element is about the rate, so an SGD-sized rate is told.
    ``"error_feedback"`` extrapolates the gradient, which SGD's step follows in size: SGD is refused. Clipping
    by norm (``gradient_clip_val``) under ``"nesterov"`` clips NAdam's direction, not the gradient as the
    method's reference does: told."""
    if correction is None:
        return None
    said: list[str] = []
    rate_told = False
    if correction == "nesterov" and gradient_clip_val:
        said.append(
            f"PipelineStrategy(delay_correction='nesterov') with gradient_clip_val={gradient_clip_val:g}: the "
            "clipping applies to what SGD steps with, NAdam's direction (about 1 per weight, so its norm is about "
            "the square root of the number of weights), not to the gradient as the method's reference clips it. "
            "Leave gradient clipping off with this correction."
        )
    for optimizer in optimizers:
        inner = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer
        name = type(inner).__name__
        groups = getattr(inner, "param_groups", [])
        sgd = isinstance(inner, torch.optim.SGD)
        if correction == "error_feedback" and sgd:
            raise MisconfigurationException(
                f"PipelineStrategy(delay_correction='error_feedback') with {name}: the correction extrapolates the "
                "gradient, g + beta (g - g_prev), and an SGD step grows with it (up to 1 + 2 beta times where the "
                "loss oscillates), which can make a run diverge that converges without it. Use torch.optim.AdamW or "
                "Adam (their step per element is bounded), or leave delay_correction unset with SGD "
                "(docs/schedules.md#delay-corrections)."
            )
        if correction != "nesterov":
            continue
        momentum = max((float(g.get("momentum") or 0.0) for g in groups), default=0.0)
        if not sgd or momentum > 0:
            own = f" with momentum={momentum:g}" if sgd else ""
            raise MisconfigurationException(
                f"PipelineStrategy(delay_correction='nesterov') with {name}{own}: the correction is NAdam's step "
                "direction (beta1 0.99, as the method's reference runs it) and needs an optimizer without state of "
                "its own, or the gradients go through two momentums. Use torch.optim.SGD(params, lr) without "
                "momentum (its weight_decay is NAdamW's decoupled decay here) and an Adam-sized lr, or keep "
                f"{name} and leave delay_correction unset (torch.optim.NAdam(params, lr, betas=(0.99, 0.999), "
                "momentum_decay=0.004, decoupled_weight_decay=True) with delay_correction unset is the same rule; "
                "docs/schedules.md#delay-corrections)."
            )
        rate = max((float(g["lr"]) for g in groups), default=0.0)
        if rate > NADAM_RATE_BOUND and not rate_told:
            rate_told = True
            said.append(
                f"PipelineStrategy(delay_correction='nesterov') with lr={rate:g}: the correction steps as NAdam does, "
                f"by about lr per weight and step, and rates above {NADAM_RATE_BOUND:g} are SGD's, not NAdam's (the "
                "method's reference trains at 3e-4). Lower lr to an Adam-sized rate (1e-4 to 1e-2)."
            )
    return " ".join(said) or None
