"""What crosses stages beside the hidden state, as the executor sees it: one interface.

A stage's output leaves as flat tensors and a :class:`Packing` (whether the hidden state was a tuple, and
per earlier block how many recorded values ride after it: :mod:`lightning_pipe.runtime.crossing.carried`),
which the executor hands along without reading. What travels by another route (skip connections, straight
from the stage that stashes to the one that pops: :mod:`lightning_pipe.runtime.crossing.skip_mail`) enters
at the five points of :class:`Crossing`, so the executor names nothing of skips or records.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

from torch import Tensor

from lightning_pipe.runtime.crossing.wire import Op, Packing

#: What a stage sends on: its flat tensors and their packing.
Sent = tuple[tuple[Tensor, ...], Packing]

#: An activation as received: its tensors, which of them carry a gradient, and their packing.
Received = tuple[list[Tensor], tuple[bool, ...], Packing]

#: The sends a crossing posts, added to the run's (each posted work with its op).
Sends = list[tuple[Any, Op]]


class Crossing(Protocol):
    """Values that reach a later stage by a route of their own, and their gradients back. Stages are the
    schedule's, ``num_stages`` those of the stage's chain; ``key`` is the micro-batch's shape key and
    ``alike`` the first micro-batch of the step with its shapes."""

    def after_forward(
        self, stage: int, microbatch: int, num_stages: int, key: Hashable, sent: Sent, sends: Sends, alike: int | None
    ) -> Sent:
        """Take what leaves by its own route out of ``sent``; returns what goes to the next stage."""
        ...

    def post_receives(self, stage: int, microbatch: int, num_stages: int, key: Hashable, alike: int | None) -> None:
        """Post the receives of what reaches ``stage``'s ``microbatch`` by its own route (with its hidden state's)."""
        ...

    def before_forward(
        self, stage: int, microbatch: int, num_stages: int, key: Hashable, received: Received, alike: int | None
    ) -> Received:
        """``received`` with what came by its own route after the hidden state."""
        ...

    def after_backward(self, stage: int, microbatch: int, input_grads: list[Tensor], sends: Sends) -> list[Tensor]:
        """Send back the gradients of what came by its own route; returns the hidden state's."""
        ...

    def before_backward(self, stage: int, microbatch: int, num_stages: int) -> list[Tensor]:
        """The gradients of what ``stage`` sent by its own route, to follow its output's."""
        ...

    def clear(self) -> None:
        """Forget everything in flight (the end of a synchronous step, or a failure)."""
        ...


class NoCrossing:
    """Nothing crosses by another route (a pipeline without skip connections)."""

    def after_forward(
        self, stage: int, microbatch: int, num_stages: int, key: Hashable, sent: Sent, sends: Sends, alike: int | None
    ) -> Sent:
        return sent

    def post_receives(self, stage: int, microbatch: int, num_stages: int, key: Hashable, alike: int | None) -> None:
        return None

    def before_forward(
        self, stage: int, microbatch: int, num_stages: int, key: Hashable, received: Received, alike: int | None
    ) -> Received:
        return received

    def after_backward(self, stage: int, microbatch: int, input_grads: list[Tensor], sends: Sends) -> list[Tensor]:
        return input_grads

    def before_backward(self, stage: int, microbatch: int, num_stages: int) -> list[Tensor]:
        return []

    def clear(self) -> None:
        return None
