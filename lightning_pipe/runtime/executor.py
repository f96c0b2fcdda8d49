"""Walk one rank's action list: post communication early, compute, and hand tensors along.

The executor knows nothing about Lightning or about any particular schedule. It dispatches on
action kinds, holds the stages of its rank in a dict (so several virtual stages per rank fit),
and relies on the schedule's own placement of sends and receives, which
:func:`lightning_pipe.schedules.validate` proved deadlock-free. What a run calls out to (the
user's step, a check before the first receive, a timeline) is given with each run
(:class:`Callbacks`), so the executor keeps nothing of a caller's between runs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.runtime.crossing.seam import Crossing, NoCrossing
from lightning_pipe.runtime.crossing.wire import SINGLE, Op, Packing
from lightning_pipe.runtime.overlap import OverlapHook, checked, one_after_another
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.stage import StageRunner, StepFn
from lightning_pipe.runtime.timings import Timeline
from lightning_pipe.schedules import Action, ActionKind, Schedule
from lightning_pipe.schedules.actions import comm_groups, overlap_spans


@dataclass
class _Inbox:
    """A posted receive: buffers fill when ``works`` complete."""

    works: list[Any]
    buffers: list[Tensor]
    flags: tuple[bool, ...] = ()
    packing: Packing = SINGLE  # how the tensors make the sender's value (read by the receiving stage)

    def wait(self) -> list[Tensor]:
        for work in self.works:
            work.wait()
        return self.buffers


_UNTIMED = nullcontext()


@dataclass(frozen=True)
class Callbacks:
    """What one run of the executor calls out to.

    Attributes:
        step: the user's step for a micro-batch (``step(i)``), which the first and last stages' forwards
            run (None: a run with no such forward, as a drain of backwards).
        before_receive: called before the run's first receive is set up (a check that the stages
            loaded the same batch, whose shapes the receives trust); it must allow being called again.
        timeline: records when each action ran (None: no clock is read).
    """

    step: StepFn | None = None
    before_receive: Callable[[], None] | None = None
    timeline: Timeline | None = None


@dataclass
class _Run:
    """What one call of :meth:`Executor.run_actions` keeps between actions."""

    keys: Sequence[Hashable] | Mapping[int, Hashable]
    num_stages: int
    microbatches_per_batch: int
    calls: Callbacks
    split_backward: bool = False
    checked: bool = False  # whether ``calls.before_receive`` ran
    inbox: dict[Action, _Inbox] = field(default_factory=dict)
    # activations: (tensors, packing); gradients: (tensors, SINGLE)
    outbox: dict[Action, tuple[Sequence[Tensor], Packing]] = field(default_factory=dict)
    sends: list[tuple[Any, Op]] = field(default_factory=list)
    following: dict[Action, Action] = field(default_factory=dict)  # receive -> the next one, to prefetch
    spans: dict[int, int] = field(default_factory=dict)  # overlapped units: first compute -> last
    streams: dict[tuple[int, int], Any] = field(
        default_factory=dict
    )  # (stage, micro-batch) -> its forward's CUDA stream
    alike: dict[int, int] = field(default_factory=dict)  # micro-batch -> the first of the run with its shapes


def first_alike(keys: Sequence[Hashable] | Mapping[int, Hashable]) -> dict[int, int]:
    """Each micro-batch mapped to the lowest-numbered one with the same shape key: the micro-batch
    whose tag a new shape's header takes, which sender and receiver name alike whatever order each
    runs its micro-batches in (the keys are the same on every rank)."""
    items = sorted(keys.items() if isinstance(keys, Mapping) else enumerate(keys), key=lambda item: item[0])
    first: dict[Hashable, int] = {}
    return {i: first.setdefault(key, i) for i, key in items}


def next_receives(actions: Sequence[Action], gradients: bool = False) -> dict[Action, Action]:
    """Each activation receive (and with ``gradients`` each gradient receive) mapped to the same
    stage's next receive of the same kind in ``actions``."""
    kinds = (ActionKind.RECV_ACTIVATION, ActionKind.RECV_GRADIENT) if gradients else (ActionKind.RECV_ACTIVATION,)
    following: dict[Action, Action] = {}
    last: dict[tuple[int, ActionKind], Action] = {}
    for action in actions:
        if action.kind in kinds:
            stream = (action.stage, action.kind)
            if stream in last:
                following[last[stream]] = action
            last[stream] = action
    return following


class Executor:
    """Runs a rank's part of a schedule for one batch."""

    def __init__(
        self,
        transport: Transport,
        runners: dict[int, StageRunner],
        rank: int,
        overlap: OverlapHook = one_after_another,
        crossing: Crossing | None = None,
    ) -> None:
        self.transport = transport
        self.runners = runners
        self.rank = rank
        self.overlap = overlap  # runs an overlapped unit's two halves (see lightning_pipe.runtime.overlap)
        # sends still travelling after a run that did not finish (the asynchronous schedules'), waited for next
        self._unfinished_sends: list[tuple[Any, Op]] = []
        self._side_stream: Any = None
        # what crosses by a route of its own (kept across runs: the asynchronous schedules')
        self.crossing: Crossing = crossing if crossing is not None else NoCrossing()

    def run(self, schedule: Schedule, keys: Sequence[Hashable], calls: Callbacks = Callbacks()) -> None:
        """Execute this rank's actions of a synchronous ``schedule``. ``keys[i]`` identifies
        micro-batch ``i``'s input shapes (the same on every rank), under which activation shapes
        are cached."""
        self.run_actions(
            schedule.actions[self.rank],
            schedule.chain_length,
            schedule.num_microbatches,
            keys,
            calls,
            split_backward=schedule.split_backward,
            overlapped=schedule.overlapped[self.rank] if schedule.overlapped else (),
        )

    def run_actions(
        self,
        actions: Sequence[Action],
        num_stages: int,
        microbatches_per_batch: int,
        keys: Sequence[Hashable] | Mapping[int, Hashable],
        calls: Callbacks = Callbacks(),
        finish: bool = True,
        split_backward: bool = False,
        overlapped: Sequence[Sequence[Action]] = (),
    ) -> None:
        """Execute ``actions`` (``num_stages``: the stages a micro-batch goes through, a chain's where the
        schedule has several). With ``finish`` false (asynchronous schedules between drains) the
        micro-batches in flight stay with the stages and the last sends may still be travelling:
        they are waited for at the end of the next call.

        Where the transport allows it (gloo), each activation receive is posted one receive early,
        so the data lands while this rank computes instead of being copied when it asks for it.
        Under a split backward (ZB-H1, ZB-V, interleaved zero bubble), whose weight-gradient work
        delays the next gradient receive, each gradient receive is posted one early too (once the
        forward it belongs to has run): on the benchmark MLP this cut ZB-H1's rank-0 posting from
        9.2 to 1.4 ms a step (``docs/benchmarks.md``); under 1F1B it did not pay.

        ``overlapped``: this rank's overlapped units (DualPipe's F&B), each run by :attr:`overlap`
        with its forward and its backward on two CUDA streams on a GPU (see
        :mod:`lightning_pipe.runtime.overlap`); the sends between and after them are posted once
        both halves ran."""
        run = _Run(keys, num_stages, microbatches_per_batch, calls, split_backward)
        run.alike = first_alike(keys)
        run.spans = overlap_spans(actions, overlapped)
        if self.transport.prefetches_receives:
            # gradient receives too under a split backward only (measured: no gain under 1F1B)
            run.following = next_receives(actions, gradients=split_backward)
        groups = dict(comm_groups(actions))
        timeline = calls.timeline
        if timeline is not None:
            timeline.begin_step()
        index = 0
        try:
            while index < len(actions):
                action = actions[index]
                if action.kind.is_compute:
                    end = run.spans.get(index)
                    if end is None:
                        self._compute(action, run)
                        index += 1
                    else:
                        self._overlapped(actions[index : end + 1], run)
                        index = end + 1
                    continue
                group = groups[index]
                self._post(group, run)
                index += len(group)
            with self._span(run, "wait", -1, -1):
                for work, _ in self._unfinished_sends:
                    work.wait()
                self._unfinished_sends = []
                if finish:
                    for work, _ in run.sends:
                        work.wait()
                    self.transport.finish()
                else:
                    self._unfinished_sends = run.sends
        except BaseException as error:
            self.crossing.clear()
            for runner in self.runners.values():
                runner.reset()
            if hasattr(error, "add_note") and index < len(actions):
                action = actions[index]
                error.add_note(
                    f"lightning-pipe: raised by {action.kind.name.lower()} of micro-batch {action.microbatch} on stage "
                    f"{action.stage} (rank {self.rank})"
                )
            raise
        if finish:
            self.crossing.clear()
            for runner in self.runners.values():
                runner.reset()
        if timeline is not None:
            timeline.end_step()

    @staticmethod
    def _span(run: _Run, name: str, stage: int, microbatch: int) -> AbstractContextManager[Any]:
        timeline = run.calls.timeline
        return _UNTIMED if timeline is None else timeline.span(name, stage, microbatch)

    def _activation_key(self, action: Action, run: _Run, stage: int) -> Hashable:
        return (stage, run.keys[action.microbatch], torch.is_grad_enabled())

    def _is_local(self, action: Action) -> bool:
        """A send or receive between two stages that this rank both holds."""
        ranks = self.transport.stage_ranks
        return ranks[action.peer_stage()] == ranks[action.stage]

    def _hand_over(self, group: list[Action], run: _Run) -> list[Action]:
        """Pass tensors between this rank's own stages in memory (an activation is copied, as a
        send would, so that the receiving stage's in-place work cannot touch the sender's graph);
        returns the rest of the group."""
        rest = []
        for action in group:
            if not self._is_local(action):
                rest.append(action)
            elif action.kind is ActionKind.SEND_ACTIVATION:
                tensors, packing = run.outbox.pop(action)
                flags = tuple(bool(t.requires_grad) for t in tensors)
                run.inbox[action.matching()] = _Inbox([], [t.detach().clone() for t in tensors], flags, packing)
            elif action.kind is ActionKind.SEND_GRADIENT:
                grads, _ = run.outbox.pop(action)
                run.inbox[action.matching()] = _Inbox([], [g.detach() for g in grads])
        return rest

    def _post(self, group: list[Action], run: _Run) -> None:
        group = self._hand_over(group, run)
        if not group:
            return
        ops: list[Op] = []
        for action in group:  # sends first: their headers unblock the peer
            if action.kind is ActionKind.SEND_ACTIVATION:
                tensors, packing = run.outbox.pop(action)
                key = self._activation_key(action, run, action.stage + 1)
                ops += self.transport.activation_send_ops(
                    action.stage + 1, key, tensors, packing, action.microbatch, run.alike.get(action.microbatch)
                )
            elif action.kind is ActionKind.SEND_GRADIENT:
                grads, _ = run.outbox.pop(action)
                ops += self.transport.gradient_send_ops(action.stage - 1, grads, action.microbatch)
        if (
            ops
            and not self.transport.batched
            and any(
                a.kind is ActionKind.RECV_ACTIVATION
                and a not in run.inbox
                and not self.transport.knows(self._activation_key(a, run, a.stage))
                for a in group
            )
        ):  # gloo, a header to wait for: the sends go out first, the peer may need them to send it
            with self._span(run, "post", group[0].stage, group[0].microbatch):
                early = self.transport.post(ops)
            run.sends.extend(zip(early, ops))
            ops = []
        n_sends = len(ops)
        pending: list[tuple[Action, _Inbox, int]] = []
        prefetch: list[Action] = []
        for action in group:
            if action.kind not in (ActionKind.RECV_ACTIVATION, ActionKind.RECV_GRADIENT):
                continue
            prefetch.append(action)
            if action in run.inbox:  # posted early
                continue
            box, recv_ops = self._receive(action, run)
            pending.append((action, box, len(recv_ops)))
            ops += recv_ops
        with self._span(run, "post", group[0].stage, group[0].microbatch):
            works = self.transport.post(ops)
        if self.transport.batched:  # one work may stand for the whole batch
            for _, box, _ in pending:
                box.works = works
            run.sends.extend((w, ops[0]) for w in works)
            for action, box, _ in pending:
                run.inbox[action] = box
            return
        run.sends.extend(zip(works[:n_sends], ops[:n_sends]))
        offset = n_sends
        for action, box, count in pending:
            box.works = works[offset : offset + count]
            offset += count
            run.inbox[action] = box
        for action in prefetch:
            self._prefetch(action, run)

    def _receive(self, action: Action, run: _Run) -> tuple[_Inbox, list[Op]]:
        """The buffers (in an inbox whose works are set once posted) and the ops that receive
        ``action``: an activation's shapes from its header, a gradient's from its forward's outputs."""
        if action.kind is ActionKind.RECV_GRADIENT:
            like = self.runners[action.stage].output_grad_like(action.microbatch)
            self._before_receive(run)
            buffers, ops = self.transport.gradient_recv_ops(action.stage + 1, like, action.microbatch)
            return _Inbox([], buffers), ops
        key = self._activation_key(action, run, action.stage)
        # only a new shape's header is waited for (until the sender gets there)
        header = _UNTIMED if self.transport.knows(key) else self._span(run, "wait", action.stage, action.microbatch)
        with header:
            self._before_receive(run)
            i, alike = action.microbatch, run.alike.get(action.microbatch)
            buffers, meta, ops = self.transport.activation_recv_ops(action.stage - 1, key, i, alike)
            # what reaches this stage by its own route: its headers, if new, are on their way by now (sent
            # before the sending stage's output left it, so before the one just read)
            self.crossing.post_receives(action.stage, i, run.num_stages, run.keys[i], alike)
        return _Inbox([], buffers, meta.requires_grad, meta.packing), ops

    @staticmethod
    def _before_receive(run: _Run) -> None:
        """The run's check before its first receive (the peers' shapes are trusted from then on)."""
        if run.calls.before_receive is not None and not run.checked:
            run.checked = True
            run.calls.before_receive()

    def _prefetch(self, action: Action, run: _Run) -> None:
        """Post the receive after ``action``'s now, if its shapes are known (a new shape's header
        would block until the sender gets there; a gradient's shapes are its forward's outputs,
        known once that forward has run)."""
        following = run.following.get(action)
        if following is None or following in run.inbox or self._is_local(following):
            return
        if following.kind is ActionKind.RECV_GRADIENT:
            if not self.runners[following.stage].holds(following.microbatch):
                return
        elif not self.transport.knows(self._activation_key(following, run, following.stage)):
            return
        box, recv_ops = self._receive(following, run)
        with self._span(run, "post", following.stage, following.microbatch):
            box.works = self.transport.post(recv_ops)
        run.inbox[following] = box

    def _overlapped(self, span: Sequence[Action], run: _Run) -> None:
        """An overlapped unit: its forward and its backward (B, and W where it follows) through
        :attr:`overlap`; on a GPU on two CUDA streams, the sends placed among them posted after both."""
        computes = [a for a in span if a.kind.is_compute]
        forward, backward = computes[0], computes[1:]
        device = self.transport.device
        if device.type != "cuda":
            self._one_after_another(span, forward, backward, run)
            return
        main = torch.cuda.current_stream(device)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device)
        # autograd runs a backward on its forward's stream: the forward takes the other one
        back = run.streams.get((backward[0].stage, backward[0].microbatch), main)
        ahead = self._side_stream if back == main else main
        for stream in (ahead, back):
            if stream != main:
                stream.wait_stream(main)

        def run_forward() -> None:
            with torch.cuda.stream(ahead):
                self._compute(forward, run)
            run.streams[(forward.stage, forward.microbatch)] = ahead

        def run_backward() -> None:
            with torch.cuda.stream(back):
                for a in backward:
                    self._compute(a, run)

        checked(self.overlap, run_forward, run_backward)
        main.wait_stream(self._side_stream)
        for _, group in comm_groups(span):
            self._post(group, run)

    def _one_after_another(self, span: Sequence[Action], forward: Action, backward: list[Action], run: _Run) -> None:
        """An overlapped unit off a GPU: the halves run one after the other, and each send leaves as
        soon as every compute listed before it has run (where the forward runs first, its output
        travels while the backward computes; posted after the whole unit, the next stage would wait
        for the backward too and each process would idle ``2(p - 1)`` instead of ``p - 1``)."""
        groups = comm_groups(span)
        done: set[Action] = set()

        def compute(action: Action) -> None:
            self._compute(action, run)
            done.add(action)
            while groups and all(a in done for a in span[: groups[0][0]] if a.kind.is_compute):
                self._post(groups.pop(0)[1], run)

        def run_backward() -> None:
            for a in backward:
                compute(a)

        checked(self.overlap, lambda: compute(forward), run_backward)

    def _compute(self, action: Action, run: _Run) -> None:
        runner = self.runners[action.stage]
        i = action.microbatch
        if action.kind is ActionKind.FORWARD:
            received = None
            depth = action.stage % run.num_stages  # the stage's place along its chain
            if depth > 0:
                box = run.inbox.pop(Action(ActionKind.RECV_ACTIVATION, action.stage, i))
                with self._span(run, "wait", action.stage, i):
                    tensors = self.transport.arrived(box.wait())
                    arrived = (tensors, box.flags, box.packing)
                    received = self.crossing.before_forward(
                        action.stage, i, run.num_stages, run.keys[i], arrived, run.alike.get(i)
                    )
            with self._span(run, "F", action.stage, i):
                result = runner.forward(i, run.microbatches_per_batch, received, run.calls.step)
            if depth < run.num_stages - 1:
                assert result is not None
                sent = self.crossing.after_forward(
                    action.stage, i, run.num_stages, run.keys[i], result, run.sends, run.alike.get(i)
                )
                run.outbox[Action(ActionKind.SEND_ACTIVATION, action.stage, i)] = sent
            return
        if action.kind is ActionKind.WEIGHT:
            with self._span(run, "W", action.stage, i):
                runner.backward_weight(i)
            return
        grads = None
        depth = action.stage % run.num_stages
        if depth < run.num_stages - 1:
            box = run.inbox.pop(Action(ActionKind.RECV_GRADIENT, action.stage, i))
            with self._span(run, "wait", action.stage, i):  # then those of what left by its own route
                grads = [
                    *self.transport.arrived(box.wait()),
                    *self.crossing.before_backward(action.stage, i, run.num_stages),
                ]
        with self._span(run, "B", action.stage, i):
            input_grads = runner.backward_input(i, grads) if run.split_backward else runner.backward(i, grads)
        if depth > 0:
            assert input_grads is not None
            input_grads = self.crossing.after_backward(action.stage, i, input_grads, run.sends)
            run.outbox[Action(ActionKind.SEND_GRADIENT, action.stage, i)] = (input_grads, SINGLE)
