"""Turn per-stage compute orders into full action lists with sends and receives.

Placement rule: after each compute action the rank posts, as one group, the send that the action
produced and the receive that its *next* compute action needs. Grouping a send with the receive
from the same neighbour is what keeps backends whose point-to-point calls rendezvous (NCCL) from
deadlocking in 1F1B's steady state, where both neighbours send to each other at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pipe.schedules.actions import Action, ActionKind, Schedule


def needs(action: Action, num_stages: int) -> list[Action]:
    """The receive a compute action waits for (none on the pipeline's ends). ``num_stages`` is the
    length of a chain where a schedule has several (:class:`Schedule`'s ``chain_length``)."""
    depth = action.stage % num_stages
    if action.kind is ActionKind.FORWARD and depth > 0:
        return [Action(ActionKind.RECV_ACTIVATION, action.stage, action.microbatch)]
    if action.kind is ActionKind.BACKWARD and depth < num_stages - 1:
        return [Action(ActionKind.RECV_GRADIENT, action.stage, action.microbatch)]
    return []


def produces(action: Action, num_stages: int) -> list[Action]:
    """The send a compute action's result feeds (none on the pipeline's ends)."""
    depth = action.stage % num_stages
    if action.kind is ActionKind.FORWARD and depth < num_stages - 1:
        return [Action(ActionKind.SEND_ACTIVATION, action.stage, action.microbatch)]
    if action.kind is ActionKind.BACKWARD and depth > 0:
        return [Action(ActionKind.SEND_GRADIENT, action.stage, action.microbatch)]
    return []


def with_communication(  # noqa: PLR0913  the Schedule's own fields, which it builds
    name: str,
    compute: Sequence[Sequence[Action]],
    num_stages: int,
    num_microbatches: int,
    stage_to_rank: Sequence[int],
    forward_only: bool = False,
    split_backward: bool = False,
    chains: int = 1,
    chain_of: Sequence[int] = (),
    overlapped: Sequence[Sequence[Sequence[Action]]] = (),
) -> Schedule:
    """Build a :class:`Schedule` from each rank's compute order (``compute[r]`` is rank r's). A
    weight-gradient action (W) needs nothing and feeds nothing. ``chains`` and ``chain_of``: see
    :class:`Schedule`. ``overlapped[r]``: rank r's overlapped units (consecutive computes in its
    order); a unit's receives are all posted before its first compute, so that nothing the unit
    waits for separates the computes that may run at once, and each compute's send right after it
    (run one after another, the forward's output travels while the backward computes)."""
    length = num_stages // chains
    per_rank: list[tuple[Action, ...]] = []
    for rank, order in enumerate(compute):
        units = {unit[0]: tuple(unit) for unit in (overlapped[rank] if overlapped else ())}
        inside: set[Action] = set()
        actions: list[Action] = []
        pending_sends: list[Action] = []
        for action in order:
            if action in inside:
                actions.extend(pending_sends)
                actions.append(action)
                pending_sends = produces(action, length)
                continue
            unit = units.get(action, (action,))
            inside.update(unit[1:])
            group = pending_sends + [r for a in unit for r in needs(a, length)]
            actions.extend(group)
            actions.append(action)
            pending_sends = produces(action, length)
        actions.extend(pending_sends)
        per_rank.append(tuple(actions))
    return Schedule(
        name=name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(stage_to_rank),
        actions=tuple(per_rank),
        forward_only=forward_only,
        split_backward=split_backward,
        chains=chains,
        chain_of=tuple(chain_of),
        overlapped=tuple(tuple(tuple(unit) for unit in units) for units in overlapped),
    )
