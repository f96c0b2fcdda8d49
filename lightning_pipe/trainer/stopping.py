"""``trainer.should_stop`` agreed by every rank where Lightning's fit loops read it.

A user's callback or step may set ``trainer.should_stop`` on one process only (a check on rank 0,
the last stage's loss). Lightning's loops read the flag on each process alone: the process that set
it leaves the loop (or runs the validation a stop asks for) while the others wait in the next
step's schedule for it, until the process group's timeout. Here the ranks combine the flag (stop if
any rank asks, as ``reduce_boolean_decision(..., all=False)`` combines ``EarlyStopping``'s decision)
at the points between the hooks that may set it and the loop's next read of it: after
``on_train_start``, after ``on_train_epoch_start``, after each batch's hooks (before the loop decides
whether to validate), after a validation run and after the epoch-end hooks. Every rank passes these
points in the same order, so the all-reduces pair up; one small gloo all-reduce per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_MARK = "_lightning_pipe_agrees_on_stops"


class StopAgreement:
    """The combined ``should_stop`` of every rank, over a gloo group of the world (created at the
    first agreement, which every rank reaches at the same point: the end of ``on_train_start``)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._group: ProcessGroup | None = None

    def agree(self) -> None:
        """Set ``trainer.should_stop`` on every rank to whether any rank has it set."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        flag = torch.tensor([1 if self.trainer.should_stop else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        self.trainer.should_stop = bool(flag.item())


def agree_on_stops(trainer: Any) -> None:
    """Have the fit loops of ``trainer`` combine ``should_stop`` over the ranks (once per Trainer:
    a second ``fit`` keeps the first one's wrappers)."""
    fit_loop = trainer.fit_loop
    if getattr(fit_loop, _MARK, False):
        return
    agreement = StopAgreement(trainer)
    epoch_loop = fit_loop.epoch_loop
    _after(fit_loop, "on_run_start", agreement.agree)  # on_train_start's hooks
    _after(fit_loop, "on_advance_start", agreement.agree)  # on_train_epoch_start's hooks
    _before(epoch_loop, "on_advance_end", agreement.agree)  # a batch's hooks, before the validation decision
    _after(epoch_loop.val_loop, "run", agreement.agree)  # validation's hooks
    _after(fit_loop, "on_advance_end", agreement.agree)  # on_train_epoch_end's hooks
    setattr(fit_loop, _MARK, True)


def _after(loop: Any, name: str, agree: Callable[[], None]) -> None:
    method = getattr(loop, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        agree()
        return result

    setattr(loop, name, wrapped)


def _before(loop: Any, name: str, agree: Callable[[], None]) -> None:
    method = getattr(loop, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        agree()
        return method(*args, **kwargs)

    setattr(loop, name, wrapped)
