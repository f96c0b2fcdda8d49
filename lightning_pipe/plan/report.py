"""What ``lightning-pipe plan`` prints and writes: the measured link, the ranked layouts as a table,
the chosen layout with the command-line overrides that run it, and the predicted timelines."""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from pathlib import Path

from lightning_pipe.partition.solvers.rank_order import describe_order
from lightning_pipe.partition.solvers.speeds import EQUAL_WITHIN, all_equal
from lightning_pipe.plan.planner import Candidate, Link, activations_label, activations_line, format_plans
from lightning_pipe.schedules import VIRTUAL_STAGES, build, simulate
from lightning_pipe.schedules.timeline_svg import simulated_bars, timeline_svg

#: balance modes that give the same split in any run; a measured split (time, memory) is written
#: out as its layer counts, since a new run would measure again and might split otherwise
_REPRODUCIBLE_BALANCES = ("uniform", "parameters")


def describe(c: Candidate) -> str:
    """One candidate in words: schedule, layout, chunks, balance, recompute mode (strategy.recompute), or
    each stage's activation policy where they differ."""
    virtual = f" (v={c.virtual_stages})" if c.schedule in VIRTUAL_STAGES else ""
    stages = f"{c.depth} stage" + ("s" if c.depth != 1 else "")
    replicas = f" x {c.replicas} replicas" if c.replicas > 1 else ""
    return (
        f"{c.schedule}{virtual} on {stages}{replicas}, chunks {c.chunks}, balance {c.balance_mode} "
        f"{list(c.balance)}, "
        + (f"recompute {c.recompute}" if isinstance(c.recompute, str) and not c.offload else
           f"activations {activations_label(c)}")
    )  # fmt: skip


def link_line(link: Link | None) -> str:
    """The point-to-point link the predictions used, as measured between ranks 0 and 1."""
    if link is None or (link.latency == 0 and math.isinf(link.bandwidth)):
        return "link between ranks 0 and 1: none measured (one process); transfers predicted free"
    latency = f"measured link between ranks 0 and 1: latency {1e6 * link.latency:.1f} us"
    if math.isinf(link.bandwidth):
        return latency + ", bandwidth not resolved (an activation-sized message took no longer than a 4-byte one)"
    return latency + f", bandwidth {link.bandwidth / 1e6:.0f} MB/s"


def speeds_line(c: Candidate) -> str:
    """Each rank's speed that the predictions used (relative to rank 0, whose profile they scale),
    and which rank holds which stage."""
    where = (
        f"ranks placed: {describe_order(c.rank_order, c.depth, c.replicas)}"
        if c.rank_order
        else "rank r holds stage r // replicas"
    )
    if not c.rank_speeds:
        return (
            "rank speeds: none (one process, or none given): every stage predicted at the profiling rank's speed; "
            + where
        )
    free = c.rank_free or (None,) * len(c.rank_speeds)
    speeds = ", ".join(
        f"rank {r} {v:.2f}" + (f" ({b / 2**30:.1f} GiB free)" if b is not None else "")
        for r, (v, b) in enumerate(zip(c.rank_speeds, free))
    )
    note = "" if not all_equal(c.rank_speeds) else f" (equal within {EQUAL_WITHIN:.0%}: predicted and split as equal)"
    return f"rank speeds relative to rank 0{note}: {speeds}; {where}"


def overrides(c: Candidate, stages: int, replicas: int) -> list[str]:
    """The ``lightning-pipe`` overrides that run candidate ``c`` in a run configured with ``stages``
    x ``replicas``: the strategy group named after the schedule and its keys, and, where ``c``'s
    layout differs, the pipeline depth and each replica's DataLoader batch (same global batch)."""
    balance = c.balance_mode if c.balance_mode in _REPRODUCIBLE_BALANCES else "[" + ",".join(map(str, c.balance)) + "]"
    out = [
        f"strategy={c.schedule}",
        f"strategy.chunks={c.chunks}",
        f"strategy.balance={balance}",
        "strategy.recompute=" + _value(c.recompute),
    ]
    if c.offload:
        out.append("strategy.offload=" + _value(c.offload))
    if c.schedule in VIRTUAL_STAGES:
        out.append(f"strategy.virtual_stages={c.virtual_stages}")
    if c.rank_order:
        out.append("strategy.rank_order=[" + ",".join(map(str, c.rank_order)) + "]")
    if (c.depth, c.replicas) != (stages, replicas):
        out.append(f"strategy.stages={c.depth}")
        if c.replica_batch:
            out.append(f"recipe.data.batch_size={c.replica_batch}")
    return out


def _value(value: str | Sequence[object]) -> str:
    """A value on the command line: a mode, or a list of them (``null`` for None)."""
    if isinstance(value, str):
        return value
    return "[" + ",".join("null" if v is None else str(v) for v in value) + "]"


def distinct(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates without those that differ from a better one only in their balance while every
    prediction is the same (Chimera on 2 processes holds the whole model on each, so its balance
    cannot matter): the best of each such group stands for it."""
    seen, kept = set(), []
    for c in candidates:
        key = (c.schedule, c.virtual_stages, c.chunks, c.recompute, c.offload, c.depth, c.replicas,
               round(c.step_seconds, 7), round(c.bubble, 6), c.stage_bytes)  # fmt: skip
        if key not in seen:
            seen.add(key)
            kept.append(c)
    return kept


def plan_text(candidates: Sequence[Candidate], stages: int, replicas: int, top: int = 5) -> str:
    """The report of ``lightning-pipe plan``: the link, the best ``top`` layouts, the first choice and
    the overrides (shell-quoted) that run it in a run configured with ``stages`` x ``replicas``."""
    if not candidates:
        raise ValueError("plan_text needs at least one ranked candidate")
    best = candidates[0]
    chosen = f"best: #1, {describe(best)}: {1e3 * best.step_seconds:.2f} ms per step predicted"
    if best.replicas > 1 or (best.depth, best.replicas) != (stages, replicas):
        chosen += f"; each replica's DataLoader batch {best.replica_batch}"
    shown = distinct(candidates)
    lines = [
        link_line(best.link),
        speeds_line(best),
        f"{len(candidates)} layouts ranked by predicted step time; the best {min(top, len(shown))} distinct ones:",
        format_plans(shown, top),
        chosen,
        "run it with: " + " ".join(shlex.quote(o) for o in overrides(best, stages, replicas)),
        activations_line(best),
    ]
    return "\n".join(lines)


def predicted_timelines(candidates: Sequence[Candidate], num_stages: int, top: int = 3) -> str:
    """One SVG with the predicted timeline of each of the ``top`` candidates, best first."""
    panels = []
    for i, c in enumerate(candidates[:top]):
        depth = c.stages or num_stages
        # as the planner played it: the backend's schedule under the backend's point-to-point model
        schedule = build(c.schedule, depth, c.chunks, c.virtual_stages, rendezvous=c.rendezvous)
        simulation = simulate(schedule, stage_costs=c.stage_costs, rendezvous=c.rendezvous)
        title = f"#{i + 1}: {describe(c)}: {1e3 * c.step_seconds:.2f} ms predicted"
        panels.append((title, simulated_bars(simulation)))
    return timeline_svg(panels, unit="s")


def write_plan(candidates: Sequence[Candidate], stages: int, replicas: int, folder: Path, top: int = 5) -> str:
    """Write ``plan.txt`` (:func:`plan_text`) and ``plan.svg`` (the best three's predicted
    timelines) into ``folder``; returns the text."""
    text = plan_text(candidates, stages, replicas, top)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plan.txt").write_text(text + "\n")
    (folder / "plan.svg").write_text(predicted_timelines(candidates, stages))
    return text
