"""Elastic averaging between the replicas of a stage (``replicas_sync="elastic"``, after AvgPipe).

Under ``replicas_sync="allreduce"`` the replicas of a stage average their gradients every step and
stay equal. Under ``"elastic"`` each replica steps its own weights from its own batches' gradients,
with no collective between the replicas in the step; every ``period`` optimizer steps, the replicas
and a center variable ``c`` (kept in float32 on every replica of the stage, equal on all of them) are
pulled towards each other by the synchronous rule of elastic averaging SGD (EASGD, Zhang, Choromanska
and LeCun, NeurIPS 2015), all from the values before the pull:

    d_i = x_i - c
    x_i <- x_i - alpha * d_i                  (each replica i)
    c   <- c + alpha * sum_i d_i              (one all-reduce of the d_i over the stage's replicas)

``c`` starts as the initial weights. With ``beta = replicas * alpha`` the center moves to
``(1 - beta) c + beta mean_i(x_i)``, a convex combination only for ``beta <= 1``, so larger ``alpha``
is refused; the default is ``alpha = 0.9 / replicas`` (``beta = 0.9``). Only trainable parameters take
part (buffers, such as batch-norm statistics, stay each replica's own). The pure checks come first; the
class holds the center and the collective.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

ReplicasSyncMode = Literal["allreduce", "elastic"]
#: ``replicas_sync`` values: gradients all-reduced every step, or elastic averaging every ``period`` steps.
REPLICAS_SYNC: tuple[ReplicasSyncMode, ...] = typing.get_args(ReplicasSyncMode)
#: optimizer steps between two elastic averagings where ``replicas_sync_period`` is unset
DEFAULT_PERIOD = 4
#: the default ``alpha`` is this over the number of replicas (the center's step towards their mean)
DEFAULT_BETA = 0.9


def check_replicas_sync(replicas_sync: str, period: int | None, alpha: float | None) -> None:
    """Reject bad values of ``replicas_sync`` and its period and alpha (no layout needed)."""
    if replicas_sync not in REPLICAS_SYNC:
        raise ValueError(
            f"PipelineStrategy(replicas_sync={replicas_sync!r}): unknown mode. Valid: {', '.join(REPLICAS_SYNC)}."
        )
    if period is not None and (not isinstance(period, int) or isinstance(period, bool) or period < 1):
        raise ValueError(
            f"PipelineStrategy(replicas_sync_period={period!r}): give the number of optimizer steps between two "
            f"elastic averagings, an integer >= 1 (None: {DEFAULT_PERIOD})."
        )
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha < 1.0):
        raise ValueError(
            f"PipelineStrategy(replicas_sync_alpha={alpha!r}): give the elastic coefficient, a number strictly "
            f"between 0 and 1 (None: {DEFAULT_BETA} / replicas)."
        )
    if replicas_sync != "elastic" and (period is not None or alpha is not None):
        given = "replicas_sync_period" if period is not None else "replicas_sync_alpha"
        raise ValueError(
            f"PipelineStrategy({given}=...) sets elastic averaging between the replicas, which is off under "
            f"replicas_sync={replicas_sync!r}. Add replicas_sync='elastic', or leave {given} unset."
        )


def elastic_alpha(replicas: int, alpha: float | None) -> float:
    """The elastic coefficient for ``replicas`` replicas (``alpha``, or None for the default), refusing a
    layout without replicas to average and a coefficient that would push the center past the replicas' mean."""
    if replicas < 2:
        raise ValueError(
            f"PipelineStrategy(replicas_sync='elastic') averages the replicas of each stage, and this run has "
            f"{replicas} replica. Use more processes than stages (stages=p with p x 2 or more devices), or "
            "replicas_sync='allreduce'."
        )
    value = DEFAULT_BETA / replicas if alpha is None else float(alpha)
    if replicas * value > 1.0:
        raise ValueError(
            f"PipelineStrategy(replicas_sync_alpha={alpha}) with {replicas} replicas moves the center by "
            f"replicas x alpha = {replicas * value:g} > 1 of its distance to the replicas' mean, past it. Use "
            f"replicas_sync_alpha <= {1.0 / replicas:g}, or leave it unset ({DEFAULT_BETA} / replicas)."
        )
    return value


class ElasticAverage:
    """The center variable of one rank's stage and the elastic pull every ``period`` optimizer steps.

    Args:
        named: this rank's trainable parameters by name (names unique on the rank; a parameter
            reached by several names appears once).
        group: the replicas of this rank's stage.
        period: optimizer steps between two pulls.
        alpha: the elastic coefficient.
    """

    def __init__(self, named: Mapping[str, nn.Parameter], group: ProcessGroup, period: int, alpha: float) -> None:
        self.names = list(named)
        self.params = [named[n] for n in self.names]
        self.group = group
        self.period = period
        self.alpha = alpha
        self.center = [p.detach().float().clone() for p in self.params]
        self.steps = 0  # optimizer steps taken
        self.optimizers: list[Any] = []
        self._handles: list[Any] = []
        self._restore: dict[str, Any] | None = None  # this replica's own state from a checkpoint, for the next step
        self._recenter = False  # a checkpoint without a center: take the loaded weights before the next step

    def attach(self, optimizers: Sequence[Any]) -> None:
        """Pull after every ``period``-th step of the (one) optimizer of automatic optimization."""
        self.detach()
        self.optimizers = list(optimizers)
        if self.optimizers:
            self._handles.append(self.optimizers[0].register_step_post_hook(lambda *_: self.after_step()))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def after_step(self) -> None:
        self.steps += 1
        if self.steps % self.period == 0:
            self.average()

    @torch.no_grad()
    def average(self) -> None:
        """One elastic pull (the module docstring's rule), one all-reduce of every difference at once."""
        diffs = [p.detach().float() - c for p, c in zip(self.params, self.center)]
        for param, diff in zip(self.params, diffs):
            param.sub_((self.alpha * diff).to(param.dtype))
        flat = torch.cat([d.reshape(-1) for d in diffs])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for center in self.center:
            n = center.numel()
            center.add_(flat[offset : offset + n].view_as(center), alpha=self.alpha)
            offset += n

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, stage: int, stages: int, replica: int) -> dict[str, Any]:
        """The center by name, the step count, and every replica's own weights and (positional) optimizer
        state, gathered on every replica of the stage (a collective over them: every rank calls it), each
        marked with its ``replica`` (the placement's index, which a permuted ``rank_order`` makes differ
        from the rank in the group)."""
        own = {
            "replica": replica,
            "weights": {n: p.detach().cpu().clone() for n, p in zip(self.names, self.params)},
            "optimizers": [_to_cpu(o.state_dict()) for o in self.optimizers],
        }
        replicas = dist.get_world_size(self.group)
        gathered: list[Any] = [None] * replicas
        dist.all_gather_object(gathered, own, group=self.group)
        return {
            "stage": stage,
            "stages": stages,
            "replicas": replicas,
            "steps": self.steps,
            "center": {n: c.cpu().clone() for n, c in zip(self.names, self.center)},
            "own": gathered,
        }

    def load_state_dict(self, saved: Mapping[str, Any], stage: int, stages: int, replica: int) -> None:
        """Take the saved step count and center (by name, from every stage), and, where the checkpoint
        was written under this layout, this replica's own weights and optimizer state, given to the
        parameters and the optimizer before the next step (after the checkpoint's weights, which are
        replica 0's, were loaded)."""
        self.steps = int(saved["steps"])
        center = saved["center"]
        for i, name in enumerate(self.names):
            if name in center:
                self.center[i] = center[name].to(self.center[i].device, torch.float32).clone()
        mine = saved["stages"].get(stage)
        replicas = dist.get_world_size(self.group)
        same = mine is not None and mine["stages"] == stages and mine["replicas"] == replicas
        if same:  # by the saved replica index (older checkpoints: by position, the rank in the group)
            self._restore = {o.get("replica", i): o for i, o in enumerate(mine["own"])}.get(replica)
        else:
            self._restore = None

    def center_on_loaded_weights(self) -> None:
        """The resumed checkpoint holds no center (saved under ``replicas_sync="allreduce"``, such as
        an elastic restart's that was left with one replica): the center starts at the weights it
        holds, taken before the next step (they are loaded after this)."""
        self._recenter = True

    @torch.no_grad()
    def restore(self) -> None:
        """Give this replica its own saved weights and optimizer state (once, before the first step
        after a resume under the checkpoint's layout), or center on the loaded weights."""
        if self._recenter:
            self.center = [p.detach().float().clone() for p in self.params]
            self._recenter = False
        own, self._restore = self._restore, None
        if own is None:
            return
        for name, param in zip(self.names, self.params):
            param.copy_(own["weights"][name])
        for optimizer, state in zip(self.optimizers, own["optimizers"]):
            optimizer.load_state_dict(state)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
