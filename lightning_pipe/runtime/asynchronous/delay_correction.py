"""Delay-aware corrections of the gradient an asynchronous schedule applies (``delay_correction=...``).

Under the stashing schedules (PipeDream, PipeDream-2BW, WPipe) stage ``i`` applies at update ``t`` the
gradient ``g_t = grad f_{t - d}(W(t - d))`` of a batch ``d = update_delay(...)`` updates old. A correction
turns ``g_t`` into ``c_t`` before the user's optimizer steps with it; the schedule, its order, its weight
versions and its delays stay as they are, so a correction is an option of those schedules, not a schedule
of its own (no traits row). A correction changes nothing at an update with no gradient due (a pipeline
filling).

- ``"nesterov"``: the method of Ajanthan et al., "Nesterov Method for Asynchronous Pipeline Parallel
  Optimization" (ICML 2025) as its published code runs it: PipeDream's weight stashing (the backward on
  the stashed weights, the step on the newest) with ``torch.optim.NAdam(betas=(0.99, 0.999),
  momentum_decay=0.004, decoupled_weight_decay=True)``, whose look-ahead term ``mu_{t+1} m_t`` with
  ``beta1`` near 1 is the paper's modified look-ahead. The delay enters through the stashing only; the
  optimizer does not see it. Here ``c_t`` is NAdam's direction (first and second moments, the
  momentum-decay schedule ``mu_t``, the bias corrections; :class:`NAdamDirection`), and the user's
  optimizer is plain ``SGD(lr)``: ``w -= lr * c_t`` is NAdam's step, and SGD's ``weight_decay`` (added to
  ``c_t`` times ``w``) is NAdamW's decoupled decay ``w *= 1 - lr * weight_decay``, as ``c_t`` does not depend
  on ``w``. Why a correction and not "use NAdam": the stage's schedule, its checkpoint and its refusals
  then name the method, and the coefficient (``beta1``) is the reference's unless set. Any other optimizer
  is refused before training (:func:`~lightning_pipe.trainer.compatibility.check_correction_optimizers`):
  a second momentum on top of NAdam's is not the method and multiplies the step.
- ``"error_feedback"``: ours, after Zmushko et al., "One-Step Gradient Delay is Not a Barrier for
  Large-Scale Asynchronous Pipeline Parallel LLM Pretraining" (ICML 2026), whose equations we could not
  read: update ``t - 1`` applied ``g_{t-1} = grad f(W(t - 2))`` where the gradient at its own weights was
  ``grad f(W(t - 1))``, which arrives now as ``g_t``; the error ``g_t - g_{t-1}`` is fed back:
  ``c_t = g_t + beta * (g_t - g_{t-1})`` (``c_t = g_t`` at the first update). For PipeDream-2BW, whose
  delay is one step on every stage. It extrapolates the gradient, which enlarges an SGD step by up to
  ``1 + 2 beta`` where the loss oscillates, so SGD is refused with it; an optimizer whose step per element
  is bounded (Adam, AdamW) is not enlarged.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_pipe.schedules.traits import TRAITS

Correction = Literal["nesterov", "error_feedback"]
#: The corrections by name.
CORRECTIONS: tuple[Correction, ...] = typing.get_args(Correction)
#: Each correction's coefficient where ``delay_correction_coefficient`` is unset: NAdam's beta1 (the
#: reference's ``--momentum 0.99``), error feedback's beta.
DEFAULT_COEFFICIENTS: dict[Correction, float] = {"nesterov": 0.99, "error_feedback": 0.5}
#: The reference's other NAdam settings: beta2, momentum decay psi (torch's defaults), eps.
NADAM_BETA2, NADAM_MOMENTUM_DECAY, NADAM_EPS = 0.999, 0.004, 1e-8
#: The schedules each correction runs under: Nesterov's under every rule that stashes weight versions (a fixed
#: delay per stage), error feedback under the rule whose every stage is one update late (PipeDream-2BW).
SCHEDULES_OF = {
    "nesterov": tuple(name for name, t in TRAITS.items() if t.stashes_weights),
    "error_feedback": tuple(name for name, t in TRAITS.items() if t.stashes_weights and t.one_step_delay),
}


def check_delay_correction(correction: str | None, coefficient: float | None, schedule: str) -> None:
    """Refuse, before any process starts, a correction the schedule does not run or a coefficient without one."""
    if correction is None:
        if coefficient is not None:
            raise ValueError(
                f"PipelineStrategy(delay_correction_coefficient={coefficient}) sets the coefficient of a delay "
                "correction, and none is on. Give delay_correction='nesterov' or 'error_feedback' with it, or leave "
                "delay_correction_coefficient unset."
            )
        return
    if correction not in CORRECTIONS:
        raise ValueError(
            f"PipelineStrategy(delay_correction={correction!r}) is not a delay correction; valid: "
            f"{', '.join(CORRECTIONS)} (or None: off)."
        )
    allowed = SCHEDULES_OF[correction]
    if schedule not in allowed:
        why = (
            "corrects a delay of one step on every stage (PipeDream-2BW's)"
            if correction == "error_feedback"
            else "corrects the gradients a stashing schedule applies late (PipeMare and XPipe have their own "
            "corrections; a synchronous schedule applies no gradient late)"
        )
        raise ValueError(
            f"PipelineStrategy(delay_correction={correction!r}, schedule={schedule!r}): the correction {why}. Use "
            f"schedule={' or '.join(repr(s) for s in allowed)}, or leave delay_correction unset."
        )
    if coefficient is not None and (
        isinstance(coefficient, bool) or not isinstance(coefficient, (int, float)) or not 0.0 <= coefficient < 1.0
    ):
        raise ValueError(
            f"PipelineStrategy(delay_correction_coefficient={coefficient!r}): give a number in [0, 1) "
            f"(None: {DEFAULT_COEFFICIENTS[correction]} for {correction!r})."
        )


class NAdamDirection:
    """NAdam's step direction for one tensor, torch's equations (``torch.optim.NAdam``), without the rate:
    ``mu_t = beta1 (1 - 0.5 * 0.96 ** (t psi))``, ``m_t = beta1 m_{t-1} + (1 - beta1) g_t``,
    ``v_t = beta2 v_{t-1} + (1 - beta2) g_t^2``, and
    ``c_t = ((1 - mu_t) / (1 - prod_{i<=t} mu_i) g_t + mu_{t+1} / (1 - prod_{i<=t+1} mu_i) m_t)
    / (sqrt(v_t / (1 - beta2^t)) + eps)``."""

    def __init__(self, beta1: float) -> None:
        self.beta1 = beta1

    def __call__(self, state: dict[str, Any], g: Tensor) -> Tensor:
        """``c_t`` for ``g`` (``g_t``); ``state`` (empty at the first update) is updated in place."""
        beta1, beta2, psi = self.beta1, NADAM_BETA2, NADAM_MOMENTUM_DECAY
        if not state:
            state.update(step=0, mu_product=1.0, exp_avg=torch.zeros_like(g), exp_avg_sq=torch.zeros_like(g))
        t = state["step"] = state["step"] + 1
        mu = beta1 * (1.0 - 0.5 * 0.96 ** (t * psi))
        mu_next = beta1 * (1.0 - 0.5 * 0.96 ** ((t + 1) * psi))
        mu_product = state["mu_product"] = state["mu_product"] * mu
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = v.div(1.0 - beta2**t).sqrt_().add_(NADAM_EPS)
        c = g.mul((1.0 - mu) / (1.0 - mu_product)).add_(m, alpha=mu_next / (1.0 - mu_product * mu_next))
        return c.div_(denom)


class DelayCorrection:
    """One stage's correction state by parameter name: NAdam's moments and step (``"nesterov"``) or the last
    applied gradient ``g_{t-1}`` (``"error_feedback"``).

    Args:
        kind: one of :data:`CORRECTIONS`.
        coefficient: beta1 (``"nesterov"``) or beta (``"error_feedback"``); None: :data:`DEFAULT_COEFFICIENTS`.
    """

    def __init__(self, kind: Correction, coefficient: float | None = None) -> None:
        if kind not in CORRECTIONS:
            raise ValueError(f"delay_correction={kind!r} is not a delay correction; valid: {', '.join(CORRECTIONS)}")
        self.kind = kind
        self.coefficient = DEFAULT_COEFFICIENTS[kind] if coefficient is None else float(coefficient)
        self.buffers: dict[str, Any] = {}  # by parameter name: NAdam's state (a dict), or g_{t-1}
        self._nadam = NAdamDirection(self.coefficient)

    def correct(self, grads: Mapping[str, Tensor], delay: int) -> dict[str, Tensor]:
        """``c_t`` for the gradients ``g_t`` applied at this update (by name), ``delay`` updates old (the
        stashing already accounts for it); updates the state. An update with no gradient due leaves the state
        as it is."""
        out: dict[str, Tensor] = {}
        with torch.no_grad():
            for name, g in grads.items():
                g = g.detach()
                if self.kind == "nesterov":
                    out[name] = self._nadam(self.buffers.setdefault(name, {}), g)
                    continue
                held = self.buffers.get(name)
                out[name] = g if held is None else g + self.coefficient * (g - held)
                self.buffers[name] = g.clone()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "coefficient": self.coefficient, "buffers": dict(self.buffers)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(
                f"the checkpoint's delay correction is {state.get('kind')!r} and this run's {self.kind!r}: resume "
                "it with the delay_correction it was saved with"
            )
        self.buffers = {name: _cloned(held) for name, held in state["buffers"].items()}

    def nbytes(self) -> int:
        tensors = [t for held in self.buffers.values() for t in (held.values() if isinstance(held, dict) else [held])]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))


def _cloned(held: Any) -> Any:
    if isinstance(held, dict):
        return {k: v.clone() if isinstance(v, Tensor) else v for k, v in held.items()}
    return held.clone()


def delay_correction(kind: Correction | None, coefficient: float | None, num_replicas: int) -> DelayCorrection | None:
    """This stage's correction ``kind`` (None: off) with its ``coefficient``. Refuses data-parallel
    replicas: each would keep its own correction state, which a checkpoint does not hold apart."""
    if kind is None:
        return None
    if num_replicas > 1:
        raise ValueError(
            f"delay_correction={kind!r} with {num_replicas} data-parallel replicas: each replica "
            "would keep its own correction state, which checkpoints do not hold apart yet. Run one replica "
            "(devices == stages), or leave delay_correction unset."
        )
    return DelayCorrection(kind, coefficient)


def merged_correction_state(states: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Every stage's correction state as one (buffers by name over all stages), or None where some lack one."""
    found = [state.get("delay_correction") for state in states]
    if not found or any(s is None for s in found):
        return None
    buffers: dict[str, Tensor] = {}
    for s in found:
        buffers.update(s["buffers"])  # type: ignore[index]
    return {**found[0], "buffers": buffers}  # type: ignore[dict-item]
