"""Skip connections (:mod:`lightning_pipe.skips`) in flight on one rank, beside the schedule's messages.

A stashed tensor goes straight from the stage that stashes it to the stage that pops it (never through
the stages between), and its gradient straight back; where this rank holds both stages, in memory. The
executor calls in at the points of :class:`~lightning_pipe.runtime.crossing.seam.Crossing`: after a
forward (:meth:`SkipMail.after_forward`), when the next stage's receive is posted
(:meth:`SkipMail.post_receives`), before the popping stage's forward (:meth:`SkipMail.before_forward`)
and around the backwards (:meth:`SkipMail.after_backward`, :meth:`SkipMail.before_backward`). Each wait
is on a true dependency of the schedule (a forward on an earlier stage's forward, a backward on a later
stage's backward), whose message was posted before the one the
schedule waits for, so none adds a wait the schedule's own messages would not cause.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_pipe.runtime.crossing.seam import Received, Sends, Sent
from lightning_pipe.runtime.crossing.wire import Op, TensorMeta


class SkipTransport(Protocol):
    """What the mail needs of the transport (:class:`lightning_pipe.runtime.p2p.Transport`): the skips' own
    streams. Named here, so that the crossing depends on the wire's values only, not on the transport."""

    @property
    def stage_ranks(self) -> list[int]: ...

    def skip_send_ops(
        self,
        source: int,
        target: int,
        key: Hashable,
        tensors: Sequence[Tensor],
        microbatch: int = 0,
        alike: int | None = None,
    ) -> list[Op]: ...

    def skip_recv_ops(
        self, source: int, target: int, key: Hashable, microbatch: int = 0, alike: int | None = None
    ) -> tuple[list[Tensor], TensorMeta, list[Op]]: ...

    def skip_grad_send_ops(
        self, target: int, source: int, grads: Sequence[Tensor], microbatch: int = 0
    ) -> list[Op]: ...

    def skip_grad_recv_ops(
        self, target: int, source: int, like: Sequence[Tensor], microbatch: int = 0
    ) -> tuple[list[Tensor], list[Op]]: ...

    def post_skips(self, ops: Sequence[Op]) -> list[Any]: ...

    def skips_arrived(self, buffers: list[Tensor]) -> list[Tensor]: ...


class SkipStage(Protocol):
    """What the mail needs of a stage's runner (:class:`lightning_pipe.runtime.stage.StageRunner`): its module
    (whose ``skip_sources`` and ``skip_targets`` say the routes) and what a micro-batch stashed."""

    @property
    def module(self) -> nn.Module: ...

    def skip_outputs(self, microbatch: int) -> list[Tensor]: ...


@dataclass
class _Posted:
    """A posted receive of one stashing stage's skips: its buffers fill when ``works`` complete."""

    works: list[Any]
    buffers: list[Tensor]
    flags: tuple[bool, ...]

    def wait(self) -> list[Tensor]:
        for work in self.works:
            work.wait()
        return self.buffers


class SkipMail:
    """This rank's skip connections in flight: handed over in memory between its own stages (``mail``, by
    (stashing stage, popping stage, micro-batch), a gradient's under ``-1 - micro-batch``), receives posted
    (``inbox``), and per popping stage's micro-batch what its backward sends back where (``grads_to``: how
    many of its input gradients are the hidden state's, then per stashing stage the received tensors' flags).
    Stages are the schedule's, counted along the chain the stage is on (Chimera's two directions)."""

    def __init__(self, transport: SkipTransport, runners: Mapping[int, SkipStage]) -> None:
        self.transport, self.runners = transport, runners
        self.mail: dict[tuple[int, int, int], tuple[list[Tensor], tuple[bool, ...]]] = {}
        self.inbox: dict[tuple[int, int, int], _Posted] = {}
        self.grads_to: dict[tuple[int, int], tuple[int, list[tuple[int, tuple[bool, ...]]]]] = {}

    def clear(self) -> None:
        self.mail, self.inbox, self.grads_to = {}, {}, {}

    def _pairs(self, stage: int, num_stages: int, outgoing: bool) -> list[tuple[int, int]]:
        """Per group of ``stage``'s skip connections, in order: (the other stage, how many)."""
        groups = getattr(self.runners[stage].module, "skip_targets" if outgoing else "skip_sources", ())
        base = stage - stage % num_stages
        return [(base + other, len(names)) for other, names in groups]

    def _same_rank(self, stage: int, other: int) -> bool:
        ranks = self.transport.stage_ranks
        return ranks[stage] == ranks[other]

    @staticmethod
    def _key(source: int, target: int, key: Hashable) -> Hashable:
        return ("skip", source, target, key, torch.is_grad_enabled())

    def _post(self, ops: list[Any], sends: Sends) -> None:
        sends.extend(zip(self.transport.post_skips(ops), ops))

    def after_forward(
        self,
        stage: int,
        microbatch: int,
        num_stages: int,
        key: Hashable,
        sent: Sent,
        sends: Sends,
        alike: int | None = None,
    ) -> Sent:
        """After ``stage``'s forward of ``microbatch`` (``key``: its header key; ``alike``: the first micro-batch
        of the step with its shapes, whose tag a new header takes): its stashed tensors (the last of
        ``sent``'s) to the stages that pop them, their sends added to ``sends``; returns what goes to the
        next stage."""
        pairs = self._pairs(stage, num_stages, outgoing=True)
        if not pairs:
            return sent
        tensors, packing = sent
        at = len(tensors) - sum(n for _, n in pairs)
        hidden, stashed = tensors[:at], tensors[at:]
        for target, n in pairs:
            part, stashed = list(stashed[:n]), stashed[n:]
            if self._same_rank(stage, target):  # copied, as a hand-over between this rank's stages is
                flags = tuple(bool(t.requires_grad) for t in part)
                self.mail[(stage, target, microbatch)] = ([t.detach().clone() for t in part], flags)
                continue
            ops = self.transport.skip_send_ops(stage, target, self._key(stage, target, key), part, microbatch, alike)
            self._post(ops, sends)
        return tuple(hidden), packing

    def post_receives(
        self, stage: int, microbatch: int, num_stages: int, key: Hashable, alike: int | None = None
    ) -> None:
        """Post the receives of what earlier stages on other ranks stashed for ``stage``'s ``microbatch``
        (``alike``: as :meth:`after_forward`'s)."""
        for source, _ in self._pairs(stage, num_stages, outgoing=False):
            if self._same_rank(stage, source) or (source, stage, microbatch) in self.inbox:
                continue
            header = self._key(source, stage, key)
            buffers, meta, ops = self.transport.skip_recv_ops(source, stage, header, microbatch, alike)
            self.inbox[(source, stage, microbatch)] = _Posted(
                self.transport.post_skips(ops), buffers, meta.requires_grad
            )

    def before_forward(
        self, stage: int, microbatch: int, num_stages: int, key: Hashable, received: Received, alike: int | None = None
    ) -> Received:
        """``received`` with what earlier stages stashed for ``stage`` after the hidden state."""
        pairs = self._pairs(stage, num_stages, outgoing=False)
        if not pairs:
            return received
        tensors, flags, packing = received
        self.post_receives(stage, microbatch, num_stages, key, alike)  # where the hidden state came in memory
        groups: list[tuple[int, tuple[bool, ...]]] = []
        skips: list[Tensor] = []
        for source, _ in pairs:
            if self._same_rank(stage, source):
                part, part_flags = self.mail.pop((source, stage, microbatch))
            else:
                box = self.inbox.pop((source, stage, microbatch))
                part, part_flags = self.transport.skips_arrived(box.wait()), box.flags
            skips += part
            groups.append((source, part_flags))
        if torch.is_grad_enabled():  # what the backward sends back where
            self.grads_to[(stage, microbatch)] = (sum(flags), groups)
        return [*tensors, *skips], (*flags, *(f for _, fs in groups for f in fs)), packing

    def after_backward(self, stage: int, microbatch: int, input_grads: list[Tensor], sends: Sends) -> list[Tensor]:
        """After ``stage``'s backward: the gradients of the skip connections it popped (the last of
        ``input_grads``) back to the stages that stashed them; returns the hidden state's."""
        routed = self.grads_to.pop((stage, microbatch), None)
        if routed is None:
            return input_grads
        hidden, groups = routed
        rest = input_grads[hidden:]
        for source, flags in groups:
            part, rest = rest[: sum(flags)], rest[sum(flags) :]
            if not part:
                continue
            if self._same_rank(stage, source):
                self.mail[(source, stage, -1 - microbatch)] = ([g.detach() for g in part], ())
                continue
            self._post(self.transport.skip_grad_send_ops(stage, source, part, microbatch), sends)
        return input_grads[:hidden]

    def before_backward(self, stage: int, microbatch: int, num_stages: int) -> list[Tensor]:
        """Before ``stage``'s backward: the gradients of what it stashed, from the stages that popped it."""
        pairs = self._pairs(stage, num_stages, outgoing=True)
        if not pairs:
            return []
        stashed = self.runners[stage].skip_outputs(microbatch)
        grads: list[Tensor] = []
        for target, n in pairs:
            like, stashed = [t for t in stashed[:n] if t.requires_grad], stashed[n:]
            if not like:
                continue
            if self._same_rank(stage, target):
                grads += self.mail.pop((stage, target, -1 - microbatch))[0]
                continue
            buffers, ops = self.transport.skip_grad_recv_ops(target, stage, like, microbatch)
            for work in self.transport.post_skips(ops):
                work.wait()
            grads += self.transport.skips_arrived(buffers)
        return grads
