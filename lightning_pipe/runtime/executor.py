"""Walk one rank's action list: post communication early, compute, and hand tensors along.

The executor knows nothing about Lightning or about any particular schedule. It dispatches on
action kinds, holds the stages of its rank in a dict (so several virtual stages per rank fit),
and relies on the schedule's own placement of sends and receives, which
:func:`lightning_pipe.schedules.validate` proved deadlock-free.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Hashable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_pipe.runtime.p2p import Op, Transport
from lightning_pipe.runtime.stage import StageRunner
from lightning_pipe.runtime.timeline import Timeline
from lightning_pipe.schedules import Action, ActionKind, Schedule
from lightning_pipe.schedules.actions import comm_groups


@dataclass
class _Inbox:
    """A posted receive: buffers fill when ``works`` complete."""

    works: list[Any]
    buffers: list[Tensor]
    flags: tuple[bool, ...] = ()
    was_tuple: bool = False

    def wait(self) -> list[Tensor]:
        for work in self.works:
            work.wait()
        return self.buffers


_UNTIMED = nullcontext()


class Executor:
    """Runs a rank's part of a schedule for one batch."""

    def __init__(self, transport: Transport, runners: dict[int, StageRunner], rank: int) -> None:
        self.transport = transport
        self.runners = runners
        self.rank = rank
        self.timeline: Optional[Timeline] = None  # attach one to record per-action timings
        self._carried: list[tuple[Any, Op]] = []

    def run(self, schedule: Schedule, keys: Sequence[Hashable]) -> None:
        """Execute this rank's actions of a synchronous ``schedule``. ``keys[i]`` identifies
        micro-batch ``i``'s input shapes (the same on every rank), under which activation shapes
        are cached."""
        self.run_actions(schedule.actions[self.rank], schedule.num_stages, schedule.num_microbatches, keys)

    def run_actions(
        self,
        actions: Sequence[Action],
        num_stages: int,
        microbatches_per_batch: int,
        keys: Union[Sequence[Hashable], Mapping[int, Hashable]],
        finish: bool = True,
    ) -> None:
        """Execute ``actions``. With ``finish`` false (asynchronous schedules between drains) the
        micro-batches in flight stay with the stages and the last sends may still be travelling:
        they are waited for at the end of the next call."""
        m = microbatches_per_batch
        groups = dict(comm_groups(actions))
        inbox: dict[Action, _Inbox] = {}
        outbox: dict[Action, tuple[Sequence[Tensor], bool]] = {}
        sends: list[tuple[Any, Op]] = []
        if self.timeline is not None:
            self.timeline.begin_step()
        index = 0
        try:
            while index < len(actions):
                action = actions[index]
                if action.kind.is_compute:
                    self._compute(action, m, inbox, outbox, num_stages)
                    index += 1
                    continue
                group = groups[index]
                self._post(group, keys, inbox, outbox, sends)
                index += len(group)
            with self._span("wait", -1, -1):
                for work, _ in self._carried:
                    work.wait()
                self._carried = []
                if finish:
                    for work, _ in sends:
                        work.wait()
                    self.transport.finish()
                else:
                    self._carried = sends
        except BaseException:
            for runner in self.runners.values():
                runner.reset()
            raise
        if finish:
            for runner in self.runners.values():
                runner.reset()
        if self.timeline is not None:
            self.timeline.end_step()

    def _span(self, name: str, stage: int, microbatch: int) -> ContextManager[Any]:
        return _UNTIMED if self.timeline is None else self.timeline.span(name, stage, microbatch)

    def _post(
        self,
        group: list[Action],
        keys: Union[Sequence[Hashable], Mapping[int, Hashable]],
        inbox: dict[Action, _Inbox],
        outbox: dict[Action, tuple[Sequence[Tensor], bool]],
        sends: list[tuple[Any, Op]],
    ) -> None:
        ops: list[Op] = []
        mode = torch.is_grad_enabled()
        for action in group:  # sends first: their headers unblock the peer
            if action.kind is ActionKind.SEND_ACTIVATION:
                tensors, was_tuple = outbox.pop(action)
                key = (action.stage + 1, keys[action.microbatch], mode)
                ops += self.transport.activation_send_ops(action.stage + 1, key, tensors, was_tuple)
            elif action.kind is ActionKind.SEND_GRADIENT:
                grads, _ = outbox.pop(action)
                ops += self.transport.gradient_send_ops(action.stage - 1, grads)
        n_sends = len(ops)
        pending: list[tuple[Action, _Inbox, int]] = []
        for action in group:
            if action.kind is ActionKind.RECV_ACTIVATION:
                key = (action.stage, keys[action.microbatch], mode)
                with self._span("wait", action.stage, action.microbatch):  # a new shape's header
                    buffers, meta, recv_ops = self.transport.activation_recv_ops(action.stage - 1, key)
                pending.append((action, _Inbox([], buffers, meta.requires_grad, meta.was_tuple), len(recv_ops)))
                ops += recv_ops
            elif action.kind is ActionKind.RECV_GRADIENT:
                like = self.runners[action.stage].output_grad_like(action.microbatch)
                buffers, recv_ops = self.transport.gradient_recv_ops(action.stage + 1, like)
                pending.append((action, _Inbox([], buffers), len(recv_ops)))
                ops += recv_ops
        with self._span("post", group[0].stage, group[0].microbatch):
            works = self.transport.post(ops)
        if self.transport.batched:  # one work may stand for the whole batch
            for _, box, _ in pending:
                box.works = works
            sends.extend((w, ops[0]) for w in works)
            for action, box, _ in pending:
                inbox[action] = box
            return
        sends.extend(zip(works[:n_sends], ops[:n_sends]))
        offset = n_sends
        for action, box, count in pending:
            box.works = works[offset : offset + count]
            offset += count
            inbox[action] = box

    def _compute(
        self,
        action: Action,
        num_microbatches: int,
        inbox: dict[Action, _Inbox],
        outbox: dict[Action, tuple[Sequence[Tensor], bool]],
        num_stages: int,
    ) -> None:
        runner = self.runners[action.stage]
        i = action.microbatch
        if action.kind is ActionKind.FORWARD:
            received = None
            if action.stage > 0:
                box = inbox.pop(Action(ActionKind.RECV_ACTIVATION, action.stage, i))
                with self._span("wait", action.stage, i):
                    tensors = box.wait()
                received = (tensors, box.flags, box.was_tuple)
            with self._span("F", action.stage, i):
                result = runner.forward(i, num_microbatches, received)
            if action.stage < num_stages - 1:
                assert result is not None
                outbox[Action(ActionKind.SEND_ACTIVATION, action.stage, i)] = result
            return
        grads = None
        if action.stage < num_stages - 1:
            box = inbox.pop(Action(ActionKind.RECV_GRADIENT, action.stage, i))
            with self._span("wait", action.stage, i):
                grads = box.wait()
        with self._span("B", action.stage, i):
            input_grads = runner.backward(i, grads)
        if action.stage > 0:
            assert input_grads is not None
            outbox[Action(ActionKind.SEND_GRADIENT, action.stage, i)] = (input_grads, False)
