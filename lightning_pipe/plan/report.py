"""What ``lightning-pipe plan`` writes: the ranked layouts as a table and their predicted timelines."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from lightning_pipe.plan.planner import Candidate, format_plans
from lightning_pipe.plan.timeline_svg import simulated_bars, timeline_svg
from lightning_pipe.schedules import build, simulate


def predicted_timelines(candidates: Sequence[Candidate], num_stages: int, top: int = 3) -> str:
    """One SVG with the predicted timeline of each of the ``top`` candidates, best first."""
    panels = []
    for i, c in enumerate(candidates[:top]):
        depth = c.stages or num_stages
        # as the planner played it: the backend's schedule under the backend's point-to-point model
        schedule = build(c.schedule, depth, c.chunks, c.virtual_stages, rendezvous=c.rendezvous)
        simulation = simulate(schedule, stage_costs=c.stage_costs, rendezvous=c.rendezvous)
        layout = f"{depth} stages x {c.replicas} replicas, " if c.replicas > 1 else ""
        virtual = f" (v={c.virtual_stages})" if c.virtual_stages > 1 else ""
        title = (
            f"#{i + 1}: {layout}{c.schedule}{virtual}, chunks {c.chunks}, balance {list(c.balance)} ({c.balance_mode}), "
            f"checkpoint {c.checkpoint}: {1e3 * c.step_seconds:.1f} ms predicted"
        )
        panels.append((title, simulated_bars(simulation)))
    return timeline_svg(panels, unit="s")


def write_plan(candidates: Sequence[Candidate], num_stages: int, folder: Path, top: int = 5) -> str:
    """Write ``plan.txt`` (the best ``top`` layouts) and ``plan.svg`` (the best three's predicted
    timelines) into ``folder``; returns the table."""
    table = format_plans(candidates, top)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plan.txt").write_text(table + "\n")
    (folder / "plan.svg").write_text(predicted_timelines(candidates, num_stages))
    return table


__all__ = ["predicted_timelines", "write_plan"]
