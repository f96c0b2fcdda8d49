"""A schedule as a timetable a person can read: one row per rank, one column per time unit."""

from __future__ import annotations

from lightning_pipe.schedules.actions import Schedule
from lightning_pipe.schedules.families.asynchronous import versions_held
from lightning_pipe.schedules.simulate import peak_in_flight, simulate
from lightning_pipe.schedules.traits import TRAITS


def render(
    schedule: Schedule,
    forward_cost: int = 1,
    backward_cost: int = 2,
    weight_cost: int | None = None,
    rendezvous: bool | None = None,
) -> str:
    """Timetable of ``schedule`` with integer costs; ``..`` marks idle time (the bubble). A split
    backward shows B and W (each ``backward_cost // 2`` unless ``weight_cost`` is given); with
    several stages per rank, each cell names the stage too (``F3s1``), and the timing is gloo's
    (``rendezvous`` false; see :func:`.simulate`) unless ``rendezvous`` says otherwise.

    Example (2 stages, 3 micro-batches, 1F1B)::

        rank 0 | F0 F1 .. B0 B0 F2 B1 B1 .. B2 B2
        rank 1 | .. F0 B0 B0 F1 B1 B1 F2 B2 B2 ..
    """
    if schedule.split_backward and weight_cost is None:
        weight_cost = max(1, backward_cost // 2)
        backward_cost = max(1, backward_cost - weight_cost)
    virtual = schedule.num_stages > schedule.num_ranks
    strict = not virtual if rendezvous is None else rendezvous
    sim = simulate(schedule, forward_cost, backward_cost, weight_cost, rendezvous=strict)
    width = round(sim.makespan)
    cell = max(2, len(str(schedule.num_microbatches - 1)) + 1 + (len(f"s{schedule.num_stages - 1}") if virtual else 0))
    rows = []
    for rank in range(schedule.num_ranks):
        slots = ["..".ljust(cell) for _ in range(width)]
        for action in schedule.compute(rank):
            start = round(sim.start_times[(rank, action)])
            cost = round(sim.cost(action))
            label = f"{action.kind.value}{action.microbatch}" + (f"s{action.stage}" if virtual else "")
            label = label.ljust(cell)
            for t in range(start, start + cost):
                slots[t] = label
        rows.append(f"rank {rank} | " + " ".join(slots).rstrip())
    peaks = peak_in_flight(schedule)
    footer = (
        f"{schedule.name}: {schedule.num_stages} stages, {schedule.num_microbatches} micro-batches, "
        f"bubble {sim.bubble_fraction:.1%}, peak micro-batches held per stage "
        + ", ".join(str(peaks.get(s, 0)) for s in range(schedule.num_stages))
    )
    base = schedule.name.split()[0]
    if base in TRAITS and TRAITS[base].asynchronous:
        per_batch = schedule.num_microbatches if base == schedule.name else _per_batch(schedule)
        footer += ", weight versions per stage " + ", ".join(
            str(versions_held(base, schedule.num_stages, per_batch, s)) for s in range(schedule.num_stages)
        )
    return "\n".join(rows + [footer])


def _per_batch(unrolled: Schedule) -> int:
    steps = int(unrolled.name.split("x")[-1])
    return unrolled.num_microbatches // steps
