"""The vocabulary of a schedule: what one rank does, in order, for one batch.

A schedule is data. The same per-rank action lists are validated, simulated, printed and
executed, so what the tests prove about a list is what the executor runs.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class ActionKind(enum.Enum):
    """One step of a rank's work. Compute kinds name the stage that does the work; communication
    kinds name the stage on *this* rank whose tensor is sent or received."""

    FORWARD = "F"
    BACKWARD = "B"  # the whole backward, or only the input gradient where the schedule has W actions
    WEIGHT = "W"  # the weight gradient of a backward split in two (zero-bubble schedules)
    SEND_ACTIVATION = "SEND_F"  # stage s sends its output of micro-batch i to stage s + 1
    RECV_ACTIVATION = "RECV_F"  # stage s receives its input of micro-batch i from stage s - 1
    SEND_GRADIENT = "SEND_B"  # stage s sends the gradient of its input to stage s - 1
    RECV_GRADIENT = "RECV_B"  # stage s receives the gradient of its output from stage s + 1

    # a member is its own only instance, so its identity is its hash: Enum's hashes the name in Python,
    # and simulating and validating a schedule hash actions by the million
    __hash__ = object.__hash__

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT)

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_ACTIVATION, ActionKind.SEND_GRADIENT)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_ACTIVATION, ActionKind.RECV_GRADIENT)


@dataclass(frozen=True, order=True)
class Action:
    """``kind`` of micro-batch ``microbatch`` on (virtual) stage ``stage``."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}@s{self.stage}"

    def peer_stage(self) -> int:
        """The stage at the other end of a communication action."""
        offset = _PEER_OFFSET.get(self.kind)
        if offset is None:
            raise ValueError(f"{self} is not a communication action")
        return self.stage + offset

    def matching(self) -> Action:
        """The action on the peer that pairs with this send or receive."""
        return Action(_MATCHING[self.kind], self.peer_stage(), self.microbatch)


#: where each communication kind's peer stage lies: activations go forward, gradients back
_PEER_OFFSET = {
    ActionKind.SEND_ACTIVATION: 1,
    ActionKind.RECV_GRADIENT: 1,
    ActionKind.RECV_ACTIVATION: -1,
    ActionKind.SEND_GRADIENT: -1,
}
#: each communication kind's counterpart on the peer
_MATCHING = {
    ActionKind.SEND_ACTIVATION: ActionKind.RECV_ACTIVATION,
    ActionKind.RECV_ACTIVATION: ActionKind.SEND_ACTIVATION,
    ActionKind.SEND_GRADIENT: ActionKind.RECV_GRADIENT,
    ActionKind.RECV_GRADIENT: ActionKind.SEND_GRADIENT,
}


def F(stage: int, microbatch: int) -> Action:
    return Action(ActionKind.FORWARD, stage, microbatch)


def B(stage: int, microbatch: int) -> Action:
    return Action(ActionKind.BACKWARD, stage, microbatch)


def W(stage: int, microbatch: int) -> Action:
    return Action(ActionKind.WEIGHT, stage, microbatch)


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for one batch of ``num_microbatches`` through ``num_stages`` stages.

    ``stage_to_rank[s]`` is the rank that holds stage ``s``; several stages per rank (interleaving)
    fit the same structure. ``forward_only`` schedules (evaluation) have no backward work.
    ``split_backward`` schedules run each backward as B (the input gradient, which the previous
    stage waits for) and, later, W (the weight gradient).

    Schedules with several pipelines over the same ranks (Chimera) split the stages into ``chains``
    equal chains, stage ``c x chain_length + k`` being depth ``k`` of chain ``c``; micro-batch ``i``
    goes through chain ``chain_of[i]`` only (every micro-batch through chain 0 where ``chain_of``
    is empty). Activations and gradients travel between neighbouring stages of one chain.

    ``overlapped[r]`` lists rank ``r``'s overlapped units (DualPipe's F&B): consecutive computes
    of its list, a forward of one micro-batch and the backward (B, and its W where it follows
    at once) of another, that the executor may run at the same time. Empty: none.
    """

    name: str
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    forward_only: bool = False
    split_backward: bool = False
    chains: int = 1
    chain_of: tuple[int, ...] = ()
    overlapped: tuple[tuple[tuple[Action, ...], ...], ...] = ()

    @property
    def chain_length(self) -> int:
        """Stages a micro-batch goes through (all of them, with one chain)."""
        return self.num_stages // self.chains

    def chain_stages(self, microbatch: int) -> range:
        """The stages micro-batch ``microbatch`` goes through, first to last."""
        chain = self.chain_of[microbatch] if self.chain_of else 0
        return range(chain * self.chain_length, (chain + 1) * self.chain_length)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    @property
    def virtual_stages(self) -> int:
        """Stages per rank."""
        return self.num_stages // max(1, self.num_ranks)

    def is_local(self, action: Action) -> bool:
        """Whether a communication action's peer stage lives on the same rank (a hand-over in memory)."""
        return self.rank_of(action.peer_stage()) == self.rank_of(action.stage)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.kind.is_compute]


def comm_groups(actions: Sequence[Action]) -> list[tuple[int, list[Action]]]:
    """Consecutive communication actions, which the executor posts together as one batch.

    Returns ``(index of the first action, actions)`` for each group, in list order.
    """
    groups: list[tuple[int, list[Action]]] = []
    current: list[Action] = []
    start = 0
    for index, action in enumerate(actions):
        if action.kind.is_compute:
            if current:
                groups.append((start, current))
                current = []
            continue
        if not current:
            start = index
        current.append(action)
    if current:
        groups.append((start, current))
    return groups


def overlap_spans(actions: Sequence[Action], units: Sequence[Sequence[Action]]) -> dict[int, int]:
    """For each overlapped unit that can run as one (its computes consecutive in ``actions`` with
    no receive between them, as :func:`~lightning_pipe.schedules.comm.with_communication` places
    them), the index of its first compute mapped to that of its last. A unit whose communication
    was regrouped (NCCL) so that it waits for something in between runs one compute at a time."""
    if not units:  # every schedule but DualPipeV: nothing to index, every step
        return {}
    index = {a: k for k, a in enumerate(actions) if a.kind.is_compute}
    spans: dict[int, int] = {}
    for unit in units:
        if any(a not in index for a in unit):
            continue
        start, end = index[unit[0]], index[unit[-1]]
        between = actions[start : end + 1]
        if [a for a in between if a.kind.is_compute] == list(unit) and not any(a.kind.is_recv for a in between):
            spans[start] = end
    return spans
