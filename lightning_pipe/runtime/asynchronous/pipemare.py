"""PipeMare's two techniques for asynchronous pipelines (Yang et al., "PipeMare: Asynchronous
Pipeline Parallel DNN Training", MLSys 2021), for one stage.

Which weights run what, under ``schedule="pipemare"`` in this engine. Stage ``i`` runs each
forward ``F`` of batch ``t`` during step ``t`` on its *current* weights ``w(t)`` (no stash). The
backward ``B`` of the same micro-batch runs ``lag = p - i - 1`` places later in the stage's 1F1B
stream, so on an early stage it may run in a later step, after one or more optimizer updates:
``gap = tau_fwd - tau_bkwd`` updates after its forward (:func:`backward_gap` in the schedule, and
counted here at run time). The batch's gradient is applied ``tau_i = update_delay(...)`` steps
after its forward, at the end of the step of its last backward. With ``gap = 0`` (the last stage;
the first micro-batches of a batch on the others) the backward runs on exactly the forward's
weights. With ``gap > 0`` the backward's weight-dependent products (a layer's input gradient
``dy W``) run on

- the weights of the backward's moment ``w(t + gap)`` without discrepancy correction (the paper's
  ``u_bkwd``), or
- the weights predicted for the forward's moment, ``u = w - gap * delta`` with discrepancy
  correction, where the velocity ``delta`` follows every update:
  ``delta <- gamma_i * delta + (1 - gamma_i) * (w_{k+1} - w_k)``.

The activations saved by the forward (a layer's input, Tanh's output) are the forward's in both
cases, as in the paper's model of an asynchronous pipeline: only the saved *weights* change. They
are swapped at the moment autograd unpacks them (:func:`torch.autograd.graph.saved_tensors_hooks`),
so ``u`` exists one parameter at a time, never as a whole copy: a stage holds its weights plus the
velocity (two weight-sized buffers; one on the last stage, which needs no correction; the velocity
of 16-bit weights is kept in float32). Parameters that are views of one flat buffer are told apart
by the elements of the storage each covers. A saved tensor that is not a stage weight (an
activation, or a weight already cast by autocast to another dtype, which then is the forward's
value) is kept as it is.

Learning-rate rescheduling: stage ``i``'s update ``k`` (counted from 0) steps with
``alpha_k * tau_i ** (-p_k)``, ``p_k = 1 - min(k / K, 1)`` (PipeMare's rescheduling rule): the
step size starts at ``alpha / tau_i`` and is back to the user's ``alpha_k`` after ``K`` updates.
It multiplies each param group's ``lr`` right before the optimizer's update (when the gradients
are handed over) and puts the user's value back right after it (an optimizer step post-hook), so
the user's optimizer and LR scheduler run unchanged and a checkpoint saves the user's ``lr``. A
delay of 0 (the last stage: synchronous) counts as 1.

Discrepancy correction's decay per stage: ``gamma_i = D ** (1 / tau_i)`` (over the stage's delay
of ``tau_i`` updates the old velocity decays by the factor ``D``), with ``D = pipemare_decay``
(default :data:`DEFAULT_DECAY`); a delay of 0 counts as 1. This form and the default have not been
checked against the paper's own equation here; ``D`` is an argument so that its value can be set.

Neither technique needs the weights of the previous step: the velocity update is split around the
optimizer's step, ``delta <- gamma * delta - (1 - gamma) * w_k`` before it and
``delta += (1 - gamma) * w_{k+1}`` after it (rounding of order ``(1 - gamma) * ulp(w)``).
The asynchronous schedules refuse ``accumulate_grad_batches`` other than 1, so an update
follows every batch. Activation checkpointing recomputes a forward inside its own saved-tensor
hooks, on the weights of the backward's moment, so discrepancy correction refuses ``recompute``
other than ``"never"`` (checked in :mod:`lightning_pipe.config`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe.runtime.activations.meter import SavedActivationMeter
from lightning_pipe.runtime.asynchronous.versions import stage_parameters

#: Optimizer updates over which the step size returns from ``alpha / tau_i`` to ``alpha`` (``K``).
DEFAULT_WARMUP = 1000
#: ``D`` in ``gamma_i = D ** (1 / tau_i)``: the velocity's decay over one delay.
DEFAULT_DECAY = 0.1


def lr_factor(delay: int, update: int, warmup: int) -> float:
    """``tau ** (-p_k)``, ``p_k = 1 - min(k / K, 1)``: the factor on stage's step size at update
    ``k`` (``update``) for a stage whose gradients arrive ``delay`` updates late."""
    if warmup <= 0:
        return 1.0
    tau = max(int(delay), 1)
    power = 1.0 - min(update / warmup, 1.0)
    return float(tau) ** (-power)


def velocity_decay(delay: int, decay: float = DEFAULT_DECAY) -> float:
    """``gamma_i = D ** (1 / tau_i)`` (a delay of 0 counts as 1)."""
    return decay ** (1.0 / max(int(delay), 1))


def predicted_weight(weight: Tensor, velocity: Tensor, gap: int) -> Tensor:
    """``u = w - (tau_fwd - tau_bkwd) * delta``: the weights predicted for a forward ``gap`` updates
    ago, computed in the velocity's precision and returned in the weight's dtype."""
    return (weight - gap * velocity).to(weight.dtype) if gap > 0 else weight


def velocity_dtype(dtype: torch.dtype) -> torch.dtype:
    """The velocity's dtype for weights of ``dtype``: float32 for 16-bit floats. The velocity is
    updated as ``gamma * delta - (1 - gamma) * w_k`` then ``+ (1 - gamma) * w_{k+1}``: in bfloat16
    the two large terms cancel and leave mostly rounding (8 bits of mantissa)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


@dataclass(frozen=True)
class _Span:
    """The elements ``[start, stop)`` of a storage that one parameter (of ``dtype``) covers."""

    name: str
    dtype: torch.dtype
    start: int
    stop: int


def _extent(tensor: Tensor) -> tuple[int, int]:
    """``[first, last + 1)``: the storage elements a strided tensor reaches."""
    start = int(tensor.storage_offset())
    if tensor.numel() == 0:
        return start, start
    return start, start + 1 + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride()))


def storage_spans(params: Mapping[str, Tensor]) -> dict[int, list[_Span]]:
    """Each storage's parameters with the elements they cover. Parameters may share one storage as
    views of a flat buffer (cuDNN's ``flatten_parameters`` lays out an LSTM's weights so): a saved
    view is then told apart by where it lies in the storage, not by the storage alone."""
    spans: dict[int, list[_Span]] = {}
    for name, p in params.items():
        start, stop = _extent(p)
        spans.setdefault(p.untyped_storage().data_ptr(), []).append(_Span(name, p.dtype, start, stop))
    return spans


def owner(spans: list[_Span], tensor: Tensor) -> _Span | None:
    """The parameter whose elements hold all of ``tensor`` (a view of it), or None (a tensor over
    several parameters, such as the flat buffer itself, or of another dtype: kept as it is)."""
    start, stop = _extent(tensor)
    for span in spans:
        if span.dtype == tensor.dtype and span.start <= start and stop <= span.stop:
            return span
    return None


@dataclass(frozen=True)
class _SavedWeight:
    """A stage weight (or a view of it) that autograd saved: found again at the backward."""

    name: str
    size: torch.Size
    stride: tuple[int, ...]
    offset: int | torch.SymInt  # from the first element of the weight
    update: int  # updates applied when the forward ran


class PipeMare:
    """One stage's PipeMare state: the learning-rate factor around the user's optimizer and the
    velocity behind the backward's predicted weights (see the module docstring).

    Args:
        module: the stage's layers (parameters by the names they have there).
        delay: ``tau_i``, the stage's update delay from the schedule (``update_delay``).
        warmup: ``K``; 0 turns learning-rate rescheduling off.
        correction: whether backwards run on the predicted weights (else on the current ones).
        decay: ``D`` in ``gamma_i = D ** (1 / tau_i)`` (None: :data:`DEFAULT_DECAY`, as the
            strategy's ``pipemare_decay`` left unset).
        outside: the trainable parameters outside the split layers on this rank, by their names in the
            user's model: treated as the stage's own
            (see :func:`~lightning_pipe.runtime.asynchronous.versions.stage_parameters`).
    """

    def __init__(
        self,
        module: nn.Module,
        delay: int,
        warmup: int,
        correction: bool,
        decay: float | None = None,
        outside: Mapping[str, nn.Parameter] | None = None,
    ) -> None:
        self.module = module
        self.named = stage_parameters(module, outside)
        self.delay = delay
        self.warmup = warmup
        self.correction = correction
        self.gamma = velocity_decay(delay, DEFAULT_DECAY if decay is None else decay)
        self.updates = 0  # optimizer updates applied so far (k)
        # the last stage's backwards always follow their forwards within a step: no velocity there
        needs_velocity = correction and delay > 0
        self.velocity: dict[str, Tensor] = {
            name: torch.zeros_like(p, dtype=velocity_dtype(p.dtype), memory_format=torch.preserve_format)
            for name, p in self.named.items()
            if needs_velocity and p.requires_grad
        }
        self._optimizers: list[Optimizer] = []
        self._handles: list[Any] = []
        self._saved_lr: dict[int, list[Any]] = {}  # optimizer id -> the user's lr per group, while scaled
        self._velocity_open = False

    # ------------------------------------------------------------------ the backward's weights
    def saving(self, meter: SavedActivationMeter | None = None) -> AbstractContextManager[Any]:
        """Around a forward: autograd saves each stage weight as a reference, and the backward gets
        the weights of its own moment (corrected when correction is on) instead of the forward's.
        Other saved tensors go through ``meter``'s hooks when one is counting them."""
        keep: Callable[[Tensor], Any] = meter.pack if meter is not None else (lambda tensor: tensor)
        restore: Callable[[Any], Any] = meter.unpack if meter is not None else (lambda saved: saved)
        params = self.named
        by_storage = storage_spans(self.forward_weights(refresh=False) or params)
        update = self.updates

        def pack(tensor: Tensor) -> Any:
            try:
                spans = by_storage.get(tensor.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # no storage (a sparse or nested tensor)
                return keep(tensor)
            span = owner(spans, tensor) if spans else None
            if span is None:
                return keep(tensor)
            offset = tensor.storage_offset() - span.start  # from the weight's first element
            return _SavedWeight(span.name, tensor.size(), tensor.stride(), offset, update)

        def unpack(saved: Any) -> Any:
            return self.backward_weight(saved, params) if isinstance(saved, _SavedWeight) else restore(saved)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def backward_weight(self, saved: _SavedWeight, params: Mapping[str, Tensor]) -> Tensor:
        """The saved weight (or its view) as the backward uses it now (``params``: the stage's by name)."""
        base = self.backward_base(saved.name, params[saved.name].detach(), self.updates - saved.update)
        return base.as_strided(saved.size, saved.stride, saved.offset + base.storage_offset())

    def backward_base(self, name: str, weight: Tensor, gap: int) -> Tensor:
        """The whole weight ``name`` (now ``weight``) for a backward ``gap`` updates after its forward."""
        if self.correction and gap > 0 and name in self.velocity:
            return predicted_weight(weight, self.velocity[name], gap)
        return weight

    def forward_weights(self, refresh: bool = True) -> dict[str, Tensor] | None:
        """The tensors a batch's forwards run on, by parameter name, or None: the parameters
        themselves (PipeMare). ``refresh``: compute them for the current weights first."""
        return None

    # ------------------------------------------------------------------ around the optimizer's update
    def attach(self, optimizers: Iterable[Optimizer]) -> None:
        """Follow the user's optimizers: after each one's step, its ``lr`` comes back and the
        velocity takes the new weights."""
        self.detach()
        for optimizer in optimizers:
            self._optimizers.append(optimizer)
            self._handles.append(optimizer.register_step_post_hook(self._after_step))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._optimizers.clear()
        self._saved_lr.clear()

    @property
    def factor(self) -> float:
        """The step-size factor of the next update."""
        return lr_factor(self.delay, self.updates, self.warmup)

    def before_update(self) -> None:
        """The optimizer changes the parameters next: scale its step size and start the velocity's
        update. Called once or more (gradient accumulation) before each step."""
        if self._saved_lr or self._velocity_open:
            return
        if not self._optimizers:
            raise RuntimeError("PipeMare follows the optimizer's steps: attach the optimizers before the first update")
        factor = self.factor
        for optimizer in self._optimizers:
            self._saved_lr[id(optimizer)] = [group["lr"] for group in optimizer.param_groups]
            if factor != 1.0:
                for group in optimizer.param_groups:
                    group["lr"] = group["lr"] * factor
        if self.velocity:
            params = self.named
            with torch.no_grad():
                for name, v in self.velocity.items():
                    v.mul_(self.gamma).add_(params[name].detach(), alpha=-(1.0 - self.gamma))
        self._velocity_open = True

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        saved = self._saved_lr.pop(id(optimizer), None)
        if saved is None:
            return  # a step without handed-over gradients (nothing was armed)
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr
        if not self._saved_lr:
            self._finish_update()

    def _finish_update(self) -> None:
        if not self._velocity_open:
            return
        if self.velocity:
            params = self.named
            with torch.no_grad():
                for name, v in self.velocity.items():
                    v.add_(params[name].detach(), alpha=1.0 - self.gamma)
        self._velocity_open = False
        self.updates += 1

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The update counter ``k`` and the velocity (by parameter name), between steps."""
        return {"updates": self.updates, "velocity": {n: v.detach().clone() for n, v in self.velocity.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.updates = int(state["updates"])
        velocity = state.get("velocity") or {}
        with torch.no_grad():
            for name, v in self.velocity.items():
                if name in velocity:
                    v.copy_(velocity[name].to(v.device))
                else:
                    v.zero_()

    def nbytes(self) -> int:
        """Bytes of the velocity: PipeMare's one extra weight-sized buffer."""
        return sum(v.numel() * v.element_size() for v in self.velocity.values())
