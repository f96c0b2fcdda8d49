"""Asynchronous schedules: 1F1B without a flush between batches (PipeDream, PipeDream-2BW, PipeMare,
XPipe, WPipe).

The micro-batches of consecutive batches form one stream. Stage ``s`` runs each forward ``F(g)``
followed by the backward of the micro-batch ``k = p - s - 1`` places earlier, ``B(g - k)``, so in
the steady state no stage waits. A :class:`Schedule` here describes one *steady step*: the forwards
of the current batch (micro-batches ``0..m-1``) and the backwards due meanwhile, some of which
belong to the previous batch (negative ids). :func:`unroll` lays several steps end to end, with
the first step's warm-up and the final drain, as one ordinary schedule over global ids, which the
usual validator and simulator check.

The two schedules share this order and differ in when a stage applies a batch's gradient
(:func:`update_delay`): PipeDream at the first step boundary after the stage's own backward of
the batch finished; PipeDream-2BW one step later than the batch, on every stage, so that
``W(t+1) = W(t) - lr * grad f(W(t-1))`` with at most two weight versions. PipeMare (Yang et al.,
MLSys 2021) runs PipeDream's order and delays without stashing: every forward uses the stage's
current weights (see :mod:`lightning_pipe.runtime.asynchronous.pipemare` for its learning-rate rescheduling and
discrepancy correction). XPipe (Guan et al., arXiv 1911.04610) runs the same order and delays with
each batch's forwards and backwards on the weights predicted for the update that applies the
batch's gradient (see :mod:`lightning_pipe.runtime.asynchronous.xpipe`). WPipe (Yang et al., ICLR 2022) splits the
stages into two groups, G0 (the first ``p // 2``) and G1 (the rest): G0 runs this stream and applies a
batch's gradient one step late, as 2BW; G1 finishes each batch's backwards within its step and applies
them at once, so its forwards always see every earlier batch's update (:func:`wpipe`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from lightning_pipe.schedules.actions import Action, ActionKind, B, F, Schedule
from lightning_pipe.schedules.comm import with_communication


def lag(num_stages: int, stage: int) -> int:
    """How many micro-batches stage ``stage``'s backward trails its forward."""
    return num_stages - stage - 1


def _steady(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"num_stages and num_microbatches must be >= 1, got {num_stages} and {num_microbatches}")
    compute = []
    for s in range(num_stages):
        k = lag(num_stages, s)
        order: list[Action] = []
        for i in range(num_microbatches):
            order += [F(s, i), B(s, i - k)]
        compute.append(order)
    return with_communication(name, compute, num_stages, num_microbatches, range(num_stages))


def pipedream(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream's 1F1B with weight stashing: one steady step."""
    return _steady("pipedream", num_stages, num_microbatches)


def pipemare(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeMare: PipeDream's order and update delays with one weight version per stage (no stash)."""
    return _steady("pipemare", num_stages, num_microbatches)


def xpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """XPipe: PipeDream's order and update delays, forwards and backwards on predicted weights."""
    return _steady("xpipe", num_stages, num_microbatches)


def wpipe_second_group(num_stages: int) -> int:
    """The first stage of WPipe's second group (G1): the stages below it (G0, the first half) apply a
    batch's gradient one step late, this one and the later ones in the batch's own step."""
    return num_stages // 2


def wpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """WPipe: one steady step. G0's stages run PipeDream's stream (each forward, then the backward
    ``p - s - 1`` micro-batches earlier, some of the previous batch); G1's stages run 1F1B within the
    batch (``p - s - 1`` warm-up forwards, then one forward / one backward, then the rest), so a batch's
    backwards on G1 end in its own step. Needs ``m >= p - 1`` so that G0's backwards end within the
    next step and two weight versions suffice, as under 2BW."""
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"num_stages and num_microbatches must be >= 1, got {num_stages} and {num_microbatches}")
    if num_microbatches < min_chunks("wpipe", num_stages):
        raise ValueError(
            f"wpipe keeps two weight versions on its first half of stages, which needs chunks >= stages - 1; "
            f"got chunks={num_microbatches} with {num_stages} stages. Use chunks >= {num_stages - 1} or "
            "schedule='pipedream'."
        )
    m, late = num_microbatches, wpipe_second_group(num_stages)
    compute: list[list[Action]] = []
    for s in range(num_stages):
        k = lag(num_stages, s)
        order: list[Action] = []
        if s < late:
            for i in range(m):
                order += [F(s, i), B(s, i - k)]
        else:
            warmup = min(k, m)
            order = [F(s, i) for i in range(warmup)]
            for i in range(m - warmup):
                order += [F(s, warmup + i), B(s, i)]
            order += [B(s, i) for i in range(m - warmup, m)]
        compute.append(order)
    schedule = with_communication("wpipe", compute, num_stages, m, range(num_stages))
    if not 0 < late < num_stages:
        return schedule
    actions = list(schedule.actions)
    actions[late - 1] = _after_the_last_gradient(actions[late - 1], lag(num_stages, late - 1))
    return replace(schedule, actions=tuple(actions))


def _after_the_last_gradient(actions: tuple[Action, ...], k: int) -> tuple[Action, ...]:
    """G0's last stage computes the next batch's first ``k`` forwards before its last backwards of
    the previous batch, but G1 takes that batch's activations only once it finished the previous
    batch: the sends of those activations wait until its last gradient arrives (posted with that
    receive), so that no send waits for a receive posted behind it."""
    deferred = [a for a in actions if a.kind is ActionKind.SEND_ACTIVATION and a.microbatch < k]
    last = Action(ActionKind.RECV_GRADIENT, actions[0].stage, -1)
    out: list[Action] = []
    for a in actions:
        if a in deferred:
            continue
        out.append(a)
        if a == last:
            out += deferred
    return tuple(out)


def min_chunks(name: str, num_stages: int) -> int:
    """The fewest micro-batches per batch with which ``name`` can run batch after batch without a
    drain: PipeDream-2BW (and WPipe's first group) needs ``p - 1`` so that a batch's backwards end
    within the next step."""
    return max(1, num_stages - 1) if name in ("pipedream_2bw", "wpipe") else 1


def isolated_step(num_stages: int, num_microbatches: int) -> Schedule:
    """One batch with too few micro-batches for a steady step (an epoch's short last batch): the
    steady order, to be run from an empty pipeline and drained at once, so no batch overlaps it."""
    return _steady("isolated", num_stages, num_microbatches)


def pipedream_2bw(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream-2BW: one steady step. Needs ``m >= p - 1`` so that a batch's backwards end within
    the next step and two weight versions suffice."""
    if num_microbatches < min_chunks("pipedream_2bw", num_stages):
        raise ValueError(
            f"pipedream_2bw keeps two weight versions, which needs chunks >= stages - 1; got chunks="
            f"{num_microbatches} with {num_stages} stages. Use chunks >= {num_stages - 1} or schedule='pipedream'."
        )
    return _steady("pipedream_2bw", num_stages, num_microbatches)


def update_delay(name: str, num_stages: int, num_microbatches: int, stage: int) -> int:
    """Steps between a batch's step and the step whose optimizer update applies its gradient."""
    if name == "pipedream_2bw":
        return 1
    if name == "wpipe":  # G0 one step late, G1 at once
        return int(stage < wpipe_second_group(num_stages))
    if name in ("pipedream", "pipemare", "xpipe"):
        return math.ceil(lag(num_stages, stage) / num_microbatches)
    raise ValueError(f"{name!r} is not an asynchronous schedule (see lightning_pipe.schedules.traits.ASYNC_SCHEDULES)")


def versions_held(name: str, num_stages: int, num_microbatches: int, stage: int) -> int:
    """Weight versions stage ``stage`` holds at once: the current one plus one per batch still
    waiting for backwards (PipeDream's stashing; always 2 or fewer for 2BW); PipeMare keeps only
    the current one (its discrepancy correction adds a velocity buffer, not a version); XPipe the
    current one plus the prediction its forwards run on, where a gradient arrives late; WPipe two on
    its first group (G0) and one on the second (G1)."""
    if name == "pipemare":
        return 1
    if name == "xpipe":
        return 1 + (lag(num_stages, stage) > 0)
    if name == "wpipe":  # G0 keeps the version its batch's last backwards need, as 2BW; G1 none
        return 1 + (stage < wpipe_second_group(num_stages))
    return 1 + math.ceil(lag(num_stages, stage) / num_microbatches)


def backward_gap(num_stages: int, num_microbatches: int, stage: int, microbatch: int) -> int:
    """Optimizer steps between micro-batch ``microbatch``'s forward and its backward on ``stage``
    (in the steady state): its backward runs in the step of the forward ``lag`` places later.
    PipeMare's ``tau_fwd - tau_bkwd`` for that micro-batch."""
    return (microbatch + lag(num_stages, stage)) // num_microbatches


def step_actions(steady: Schedule, rank: int, step: int, start_step: int = 0) -> list[Action]:
    """Rank ``rank``'s actions in step ``step`` with global micro-batch ids (``step * m + i``).
    The pipeline was last empty before ``start_step``: work on earlier micro-batches is left out."""
    m = steady.num_microbatches
    first = start_step * m
    return [
        Action(a.kind, a.stage, a.microbatch + step * m)
        for a in steady.actions[rank]
        if a.microbatch + step * m >= first
    ]


def drain_actions(steady: Schedule, rank: int, last_step: int, start_step: int = 0) -> list[Action]:
    """The backwards (with their communication) still owed after step ``last_step``: what the
    following steady steps would do for micro-batches up to that step, forwards left out."""
    m = steady.num_microbatches
    end, first = (last_step + 1) * m, start_step * m
    longest = lag(steady.num_stages, 0)
    out: list[Action] = []
    for step in range(last_step + 1, last_step + 2 + math.ceil(longest / m)):
        for a in steady.actions[rank]:
            gid = a.microbatch + step * m
            if first <= gid < end:
                out.append(Action(a.kind, a.stage, gid))
    return out


def unroll(steady: Schedule, steps: int) -> Schedule:
    """``steps`` consecutive steps from an empty pipeline, then the drain, over global ids."""
    actions = []
    for rank in range(steady.num_ranks):
        flat: list[Action] = []
        for t in range(steps):
            flat += step_actions(steady, rank, t)
        flat += drain_actions(steady, rank, steps - 1)
        actions.append(tuple(flat))
    return Schedule(
        name=f"{steady.name} x{steps}",
        num_stages=steady.num_stages,
        num_microbatches=steps * steady.num_microbatches,
        stage_to_rank=steady.stage_to_rank,
        actions=tuple(actions),
    )


def steady_state_bubble(
    steady: Schedule, steps: int = 4, forward_cost: float = 1.0, backward_cost: float = 2.0, rendezvous: bool = True
) -> float:
    """Idle share of a step once the pipeline is full: one more step costs ``makespan(n + 1) -
    makespan(n)``, against ``m`` forwards and backwards of work per stage. ``rendezvous``: the
    simulator's strict model (see :func:`~lightning_pipe.schedules.simulate.simulate`); WPipe's unrolled
    steps need gloo's (False): the unrolled list joins a G1 stage's last send of a batch and its first
    receive of the next into one group, which the runtime posts in two steps."""
    from lightning_pipe.schedules.simulate import simulate

    longer = simulate(unroll(steady, steps + 1), forward_cost, backward_cost, rendezvous=rendezvous).makespan
    shorter = simulate(unroll(steady, steps), forward_cost, backward_cost, rendezvous=rendezvous).makespan
    work = steady.num_microbatches * (forward_cost + backward_cost)
    return 1.0 - work / (longer - shorter)
