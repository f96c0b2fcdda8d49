"""XPipe's weight prediction for asynchronous 1F1B (Guan et al., "XPipe: Efficient Pipeline Model
Parallelism for Multi-GPU DNN Training", arXiv 1911.04610), for one stage.

Under ``schedule="xpipe"`` stage ``i`` runs PipeDream's order and update delays: batch ``t``'s
gradient is applied ``s = tau_i = update_delay(...)`` updates after its forward, at the end of step
``t + s``. Its forwards and backwards therefore run on the weights predicted for that update,
``w_hat ~ w(t + s)``, instead of the stale ``w(t)`` (PipeDream keeps ``w(t)`` in a stash; PipeMare
runs the forward on ``w(t)``). The prediction for the forwards of a step is computed once, when
the step starts, into one weight-sized buffer (the forwards' weight version aliases it). A
backward that runs ``gap`` updates after its forward (an early stage's first micro-batches) aims
at the same update ``t + s``, predicted from the weights of its own moment over the ``s - gap``
updates left; it is computed one parameter at a time when autograd unpacks the saved weight
(:meth:`lightning_pipe.runtime.asynchronous.pipemare.PipeMare.saving`), so no version is stashed. The
activations saved by the forward are the forward's. The last stage (``s = 0``) runs on its weights.

The predictor works with any torch optimizer:

- ``"update"`` (default; PipeOptim, Guan et al.):
  ``w_hat = w_t + s * (w_t - w_{t-1})``: the optimizer's own last update, repeated ``s`` times. It
  keeps the last update in a second weight-sized buffer (PipeMare's velocity with ``gamma = 0``,
  float32 for 16-bit weights), so it is saved and resumed with a checkpoint.
- ``"adam"`` (XPipe's Adam-based prediction): ``w_hat = w_t - s * lr * m_hat / (sqrt(v_hat) + eps)``,
  ``m_hat = m / (1 - beta1 ** k)``, ``v_hat = v / (1 - beta2 ** k)``, from the Adam/AdamW state
  (``exp_avg``, ``exp_avg_sq``, ``step``) and the param group's ``lr``, ``betas``, ``eps``. Weight
  decay is left out of the prediction.
- ``"momentum"`` (SpecTrain, Chen et al.): ``w_hat = w_t - s * lr * v_t``
  from SGD's ``momentum_buffer`` (torch's SGD steps by ``lr * v``).

Before the optimizer has a state for a weight (its first update), every predictor gives ``w_t``.
Activation checkpointing would recompute a forward on the refreshed prediction, so ``xpipe``
refuses ``recompute`` other than ``"never"`` (checked in :mod:`lightning_pipe.config`).
"""

from __future__ import annotations

import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe.runtime.asynchronous.pipemare import PipeMare

Predictor = Literal["update", "adam", "momentum"]
#: The predictors by name.
PREDICTORS: tuple[Predictor, ...] = typing.get_args(Predictor)
#: The predictor ``xpipe`` runs where ``xpipe_predictor`` is unset.
DEFAULT_PREDICTOR: Predictor = "update"


def predict_from_update(weight: Tensor, last_update: Tensor, steps: int) -> Tensor:
    """PipeOptim: ``w_hat = w_t + s * (w_t - w_{t-1})`` with ``last_update = w_t - w_{t-1}``."""
    if steps <= 0:
        return weight
    return (weight + steps * last_update).to(weight.dtype)


def predict_adam(
    weight: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    steps: int,
) -> Tensor:
    """XPipe: ``w_hat = w_t - s * lr * m_hat / (sqrt(v_hat) + eps)`` with Adam's bias-corrected moments."""
    if steps <= 0 or step <= 0:
        return weight
    m_hat = exp_avg / (1.0 - betas[0] ** step)
    v_hat = exp_avg_sq / (1.0 - betas[1] ** step)
    return (weight - steps * lr * m_hat / (v_hat.sqrt() + eps)).to(weight.dtype)


def predict_momentum(weight: Tensor, momentum: Tensor, lr: float, steps: int) -> Tensor:
    """SpecTrain: ``w_hat = w_t - s * lr * v_t`` with SGD's momentum buffer ``v_t``."""
    if steps <= 0:
        return weight
    return (weight - steps * lr * momentum).to(weight.dtype)


class XPipe(PipeMare):
    """One stage's XPipe state: the prediction buffer the forwards run on, the predictor, and (for
    ``"update"``) the last update. PipeMare's machinery supplies the saved-weight hooks, the update
    counter, the hooks around the optimizer's step and the checkpointed state.

    Args:
        module: the stage's layers (parameters by the names they have there).
        delay: ``s``, the stage's update delay from the schedule (``update_delay``).
        predictor: one of :data:`PREDICTORS`.
        warmup: PipeMare's learning-rate rescheduling ``K`` (0: off, the default under ``xpipe``).
        outside: the trainable parameters outside the split layers on this rank (see :class:`PipeMare`).
    """

    def __init__(
        self,
        module: nn.Module,
        delay: int,
        predictor: Predictor = DEFAULT_PREDICTOR,
        warmup: int = 0,
        outside: Mapping[str, nn.Parameter] | None = None,
    ) -> None:
        if predictor not in PREDICTORS:
            raise ValueError(f"xpipe_predictor={predictor!r} is not a predictor; valid: {', '.join(PREDICTORS)}.")
        # the velocity of gamma = 0 is the last update, w_{k+1} - w_k; only "update" reads it
        super().__init__(module, delay, warmup, correction=predictor == "update", outside=outside)
        self.gamma = 0.0
        self.predictor = predictor
        self.buffers: dict[str, Tensor] = {
            name: torch.empty_like(p, memory_format=torch.preserve_format)
            for name, p in self.named.items()
            if delay > 0 and p.requires_grad
        }
        self._params = self.named
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (its optimizer, its param group), by index

    def attach(self, optimizers: Iterable[Optimizer]) -> None:
        """Follow the user's optimizers. Where each parameter sits is kept, not the param groups or the
        state themselves: loading an optimizer's state (a resume, an elastic restart) replaces both,
        and the predictor must read the ones the optimizer steps with."""
        optimizers = list(optimizers)
        super().attach(optimizers)
        self._where = {
            id(p): (i, g)
            for i, o in enumerate(optimizers)
            for g, group in enumerate(o.param_groups)
            for p in group["params"]
        }

    def _optimizer_of(self, param: Tensor) -> tuple[dict[str, Any], Any] | None:
        """``param``'s param group and optimizer state (None: no update yet) as the optimizer holds them
        now, or None where no optimizer updates it."""
        where = self._where.get(id(param))
        if where is None:
            return None
        optimizer = self._optimizers[where[0]]
        return optimizer.param_groups[where[1]], optimizer.state.get(param)

    def predicted(self, name: str, param: Tensor, steps: int) -> Tensor:
        """``param``'s weight predicted ``steps`` updates ahead by the stage's predictor."""
        weight = param.detach()
        if steps <= 0:
            return weight
        if self.predictor == "update":
            last = self.velocity.get(name)
            return weight if last is None else predict_from_update(weight, last, steps)
        found = self._optimizer_of(param)
        if found is None:
            return weight  # no optimizer updates it
        group, state = found
        if self.predictor == "adam":
            if "betas" not in group or (state and ("exp_avg" not in state or "exp_avg_sq" not in state)):
                raise ValueError(
                    f"xpipe_predictor='adam' reads Adam's moments, which the optimizer of {name!r} does not keep. "
                    "Use an Adam/AdamW optimizer, or xpipe_predictor='update' (any optimizer)."
                )
            if not state:
                return weight  # no update yet
            step = int(state["step"])
            return predict_adam(
                weight, state["exp_avg"], state["exp_avg_sq"], step, group["lr"], group["betas"], group["eps"], steps
            )
        if not group.get("momentum") or (state and state.get("momentum_buffer") is None):
            raise ValueError(
                f"xpipe_predictor='momentum' reads SGD's momentum buffer, which the optimizer of {name!r} does not "
                "keep (SGD with momentum=0, or another optimizer). Use SGD(momentum>0), or xpipe_predictor='update'."
            )
        if not state:
            return weight  # no update yet
        return predict_momentum(weight, state["momentum_buffer"], group["lr"], steps)

    def forward_weights(self, refresh: bool = True) -> dict[str, Tensor] | None:
        """The weights this step's forwards run on, by name: the prediction ``s`` updates ahead
        (recomputed in the buffer with ``refresh``), the parameter itself where there is none."""
        if refresh and self.buffers:
            with torch.no_grad():
                for name, buffer in self.buffers.items():
                    buffer.copy_(self.predicted(name, self._params[name], self.delay))
        return {name: self.buffers.get(name, p) for name, p in self._params.items()}

    def backward_base(self, name: str, weight: Tensor, gap: int) -> Tensor:
        """The prediction of the same update as the forward's, over the ``s - gap`` updates left."""
        if name not in self.buffers:
            return weight
        if gap <= 0:
            return self.buffers[name]
        return self.predicted(name, self._params[name], max(self.delay - gap, 0))

    def nbytes(self) -> int:
        """Bytes beyond the weights: the prediction buffer and, for ``"update"``, the last update."""
        return super().nbytes() + sum(b.numel() * b.element_size() for b in self.buffers.values())
