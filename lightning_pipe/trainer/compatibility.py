"""What the Trainer's side allows, checked in setup before the first batch (automatic optimization, an
asynchronous schedule's accumulation, a delay correction's optimizers), each refused as Lightning's
configuration error. The layout's refusals (:mod:`lightning_pipe.assembly.refusals`) and the schedule
a step executes (:mod:`lightning_pipe.schedules.runnable`) reach the user as the same error through
:func:`as_misconfiguration`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_pipe.assembly.refusals import LayoutRefused
from lightning_pipe.schedules import is_async
from lightning_pipe.schedules.runnable import ScheduleRefused


@contextmanager
def as_misconfiguration() -> Iterator[None]:
    """A schedule the pipeline refuses (:class:`ScheduleRefused`) or a layout the assembly refuses
    (:class:`LayoutRefused`) reaches the user as Lightning's configuration error, as the other checks here do."""
    try:
        yield
    except LayoutRefused as err:
        raise MisconfigurationException(str(err)) from err
    except ScheduleRefused as err:
        raise MisconfigurationException(str(err)) from err.__cause__


def check_automatic_optimization(module: Any) -> None:
    """The strategy runs the backward itself, inside the schedule."""
    if not module.automatic_optimization:
        raise MisconfigurationException(
            "PipelineStrategy runs the backward itself, so it supports automatic optimization only. "
            "Remove `self.automatic_optimization = False` from the LightningModule."
        )


def check_async_accumulation(schedule: str, accumulate_grad_batches: int) -> None:
    """An asynchronous schedule applies one batch's gradient per optimizer step (its delays count steps)."""
    if is_async(schedule) and accumulate_grad_batches != 1:
        raise MisconfigurationException(
            f"schedule={schedule!r} applies one batch's gradient per optimizer step; "
            f"accumulate_grad_batches must be 1, got {accumulate_grad_batches} (raise `chunks` for larger batches "
            "instead)."
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
