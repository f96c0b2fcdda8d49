"""The simulation, validation and rendezvous regrouping of every built-in schedule, as recorded
before their functions were split into named steps: a digest of each schedule's action lists
(as built for gloo and for NCCL), its simulations under both communication models, per-stage
costs, a split W and overlapped units, and the messages :func:`validate` gives for schedules
broken on purpose (an action dropped, doubled or moved). Any change in behaviour changes a digest;
a deliberate one records the new digests (run this file's ``_digests()``)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from lightning_pipe.schedules import (
    TRAITS,
    DeadlockError,
    InvalidScheduleError,
    RendezvousError,
    Schedule,
    Simulation,
    build,
    simulate,
    validate,
)

#: Per schedule, at the commit before the refactoring (c785507); the five regrouped for NCCL recorded again
#: with each group's receives in their senders' order (their simulations unchanged: groups post as one).
RECORDED = {
    "1f1b": "4d23b2b74eee60dc",
    "chimera": "d970e07eebb85212",
    "dualpipev": "d7fa17a2e271bd91",
    "gpipe": "78eb345f307f6ccd",
    "interleaved_1f1b": "73a10af487b8aa08",
    "interleaved_zero_bubble": "e50fd11e7e148b57",
    "pipedream": "5553bf3593cc15fc",
    "pipedream_2bw": "738fa73e09df6b18",
    "pipemare": "9ab8171114c983b7",
    "wpipe": "9664addac05d909c",
    "xpipe": "bd2e60b31337a858",
    "zbv": "6474a31d7655509a",
    "zero_bubble": "57ae485a7e6267b5",
}

SIZES = ((2, 4), (3, 6), (4, 5))
SIMULATIONS: tuple[dict[str, Any], ...] = (
    {},
    {"rendezvous": False},
    {"stage_costs": "unequal"},
    {"stage_costs": "split", "rendezvous": False},
    {"weight_cost": 0.7},
    {"overlap": 0.8},
    {"overlap": 1.0, "rendezvous": False},
)


def _simulation(sim: Simulation) -> tuple[Any, ...]:
    starts = sorted((rank, str(action), t) for (rank, action), t in sim.start_times.items())
    return sim.makespan, sim.busy, starts, sim.forward_cost, sim.backward_cost, sim.weight_cost, sim.stage_costs


def _simulations(schedule: Schedule) -> list[Any]:
    stages = 1 + max(a.stage for actions in schedule.actions for a in actions)
    costs = {
        "unequal": [(1.0 + 0.1 * k, 2.0 + 0.3 * (k % 3)) for k in range(stages)],
        "split": [(1.0 + 0.1 * k, 1.0, 0.5 + 0.2 * k) for k in range(stages)],
    }
    out: list[Any] = []
    for kwargs in SIMULATIONS:
        given: dict[str, Any] = {k: costs[v] if k == "stage_costs" else v for k, v in kwargs.items()}
        try:
            out.append(_simulation(simulate(schedule, **given)))
        except DeadlockError as err:
            out.append(("deadlock", str(err)))
    return out


def _validation(schedule: Schedule) -> list[str]:
    out = []
    for rendezvous in (True, False):
        try:
            validate(schedule, rendezvous=rendezvous)
            out.append("valid")
        except InvalidScheduleError as err:
            out.append(str(err))
    return out


def _broken(schedule: Schedule) -> list[Schedule]:
    """``schedule`` with one action of a rank dropped, doubled, or moved one place later, at a few places."""
    out = []
    for rank, actions in enumerate(schedule.actions):
        for index in range(0, len(actions) - 1, max(1, len(actions) // 3)):
            a = list(actions)
            variants = [
                a[:index] + a[index + 1 :],
                a[: index + 1] + a[index:],
                [*a[:index], a[index + 1], a[index], *a[index + 2 :]],
            ]
            for variant in variants:
                lists = list(schedule.actions)
                lists[rank] = tuple(variant)
                out.append(dataclasses.replace(schedule, actions=tuple(lists)))
    return out


def _record(name: str, p: int, m: int, virtual: int, rendezvous: bool) -> list[Any]:
    try:
        schedule = build(name, p, m, virtual, rendezvous=rendezvous)
    except (RendezvousError, ValueError) as err:
        return ["build", type(err).__name__, str(err)]
    out: list[Any] = [[str(a) for a in actions] for actions in schedule.actions]
    out += _validation(schedule) + _simulations(schedule)
    if not rendezvous and (p, m) == SIZES[0]:
        out += [_validation(broken) for broken in _broken(schedule)]
    return out


def _digests() -> dict[str, str]:
    digests = {}
    for name, t in sorted(TRAITS.items()):
        h = hashlib.sha256()
        for p, m in SIZES:
            for virtual in (2, 3) if t.interleaved else (t.virtual_stages,):
                for rendezvous in (False, True):
                    h.update(repr((p, m, virtual, rendezvous, _record(name, p, m, virtual, rendezvous))).encode())
        digests[name] = h.hexdigest()[:16]
    return digests


def test_every_built_in_schedule_simulates_validates_and_regroups_as_recorded() -> None:
    assert _digests() == RECORDED
