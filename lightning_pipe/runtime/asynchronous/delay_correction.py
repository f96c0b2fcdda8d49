"""Delay-aware corrections of the gradient an asynchronous schedule applies (``delay_correction=...``).

Under the stashing schedules (PipeDream, PipeDream-2BW, WPipe) stage ``i`` applies at update ``t`` the
gradient ``g_t = grad f_{t - d}(W(t - d))`` of a batch ``d = update_delay(...)`` updates old. A correction
turns ``g_t`` into ``c_t`` before the user's optimizer steps with it; the schedule, its order, its weight
versions and its delays stay as they are, so a correction is an option of those schedules, not a schedule
of its own (no traits row). Both corrections are linear in the gradients they have seen, keep one
weight-sized buffer per stage, and change nothing at an update with no gradient due (a pipeline filling).

- ``"nesterov"``: Nesterov's look-ahead stretched over the delay, modelled on Ajanthan et al., "Nesterov
  Method for Asynchronous Pipeline Parallel Optimization" (ICML 2025):
  ``v_t = gamma * v_{t-1} + g_t`` and ``c_t = g_t + (gamma + gamma**2 + ... + gamma**(d + 1)) * v_t``:
  with ``d = 0`` this is torch's ``SGD(nesterov=True)`` direction ``g_t + gamma * v_t``; a gradient ``d``
  updates late looks ``d + 1`` momentum steps ahead instead of one, to where the weights will have moved by
  the time the next gradient computed on them arrives. Use it with an optimizer without momentum of its own
  (plain ``SGD``), as the correction carries the momentum.
- ``"error_feedback"``: the one-step delay's error fed back, after Zmushko et al., "One-Step Gradient Delay
  is Not a Barrier for Large-Scale Asynchronous Pipeline Parallel LLM Pretraining" (ICML 2026): update
  ``t - 1`` applied ``g_{t-1} = grad f(W(t - 2))`` where the gradient at its own weights was
  ``grad f(W(t - 1))``, which arrives now as ``g_t``; the error ``g_t - g_{t-1}`` is fed back:
  ``c_t = g_t + beta * (g_t - g_{t-1})`` (``c_t = g_t`` at the first update). For PipeDream-2BW, whose
  delay is one step on every stage; any optimizer.

The rules here are the ones these docstrings state and the tests hold the runs to; the papers' own
formulations (their step sizes, their optimizers) are not reproduced beyond them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.schedules.traits import TRAITS

#: The corrections by name.
CORRECTIONS = ("nesterov", "error_feedback")
#: Each correction's coefficient where ``delay_correction_coefficient`` is unset: Nesterov's momentum gamma,
#: error feedback's beta.
DEFAULT_COEFFICIENTS = {"nesterov": 0.9, "error_feedback": 0.5}
#: The schedules each correction runs under: Nesterov's under every rule that stashes weight versions (a fixed
#: delay per stage), error feedback under the rule whose every stage is one update late (PipeDream-2BW).
SCHEDULES_OF = {
    "nesterov": tuple(name for name, t in TRAITS.items() if t.stashes_weights),
    "error_feedback": tuple(name for name, t in TRAITS.items() if t.stashes_weights and t.one_step_delay),
}


def lookahead(gamma: float, delay: int) -> float:
    """Nesterov's look-ahead factor over a delay of ``delay`` updates: ``gamma + ... + gamma ** (delay + 1)``."""
    return sum(gamma**k for k in range(1, delay + 2))


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


class DelayCorrection:
    """One stage's correction state: Nesterov's momentum ``v`` or the last applied gradient ``g_{t-1}``.

    Args:
        kind: one of :data:`CORRECTIONS`.
        coefficient: gamma (``"nesterov"``) or beta (``"error_feedback"``); None: :data:`DEFAULT_COEFFICIENTS`.
    """

    def __init__(self, kind: str, coefficient: float | None = None) -> None:
        if kind not in CORRECTIONS:
            raise ValueError(f"delay_correction={kind!r} is not a delay correction; valid: {', '.join(CORRECTIONS)}")
        self.kind = kind
        self.coefficient = DEFAULT_COEFFICIENTS[kind] if coefficient is None else float(coefficient)
        self.buffers: dict[str, Tensor] = {}  # by parameter name: v_{t-1}, or g_{t-1}

    def correct(self, grads: Mapping[str, Tensor], delay: int) -> dict[str, Tensor]:
        """``c_t`` for the gradients ``g_t`` applied at this update (by name), ``delay`` updates old; updates
        the state. An update with no gradient due leaves the state as it is."""
        out: dict[str, Tensor] = {}
        c = self.coefficient
        with torch.no_grad():
            for name, g in grads.items():
                held = self.buffers.get(name)
                if self.kind == "nesterov":
                    v = g.detach().clone() if held is None else held.mul_(c).add_(g)
                    self.buffers[name] = v
                    out[name] = g + lookahead(c, delay) * v
                else:
                    out[name] = g if held is None else g + c * (g - held)
                    self.buffers[name] = g.detach().clone()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "coefficient": self.coefficient, "buffers": dict(self.buffers)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(
                f"the checkpoint's delay correction is {state.get('kind')!r} and this run's {self.kind!r}: resume "
                "it with the delay_correction it was saved with"
            )
        self.buffers = {name: t.clone() for name, t in state["buffers"].items()}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())


def delay_correction(options: Any, num_replicas: int) -> DelayCorrection | None:
    """This stage's correction from the pipeline's options (a
    :class:`~lightning_pipe.runtime.options.PipelineOptions`), or None where it is off. Refuses data-parallel
    replicas: each would keep its own correction state, which a checkpoint does not hold apart."""
    if options.delay_correction is None:
        return None
    if num_replicas > 1:
        raise ValueError(
            f"delay_correction={options.delay_correction!r} with {num_replicas} data-parallel replicas: each replica "
            "would keep its own correction state, which checkpoints do not hold apart yet. Run one replica "
            "(devices == stages), or leave delay_correction unset."
        )
    return DelayCorrection(options.delay_correction, options.delay_correction_coefficient)


def merged_correction_state(states: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Every stage's correction state as one (buffers by name over all stages), or None where some lack one."""
    found = [state.get("delay_correction") for state in states]
    if not found or any(s is None for s in found):
        return None
    buffers: dict[str, Tensor] = {}
    for s in found:
        buffers.update(s["buffers"])  # type: ignore[index]
    return {**found[0], "buffers": buffers}  # type: ignore[dict-item]
