"""What there is to coalesce: each schedule's messages between ranks, counted on its action lists.

    python benchmarks/messages.py --stages 2 --chunks 8

Per schedule: the sends and receives per rank and step that cross a process boundary, how many
communication groups (the sends and receives a rank posts together, between two computations)
hold more than one send to the same peer rank (messages that could travel as one without moving
anything), and how many computations lie between a rank's consecutive sends to the same peer (what
merging two of them would hold the first one back by). Pure: no processes, no timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_pipe.schedules import build
from lightning_pipe.schedules.actions import Schedule, comm_groups

#: name -> virtual stages per rank
SCHEDULES = {"1f1b": 1, "gpipe": 1, "zero_bubble": 1, "interleaved_1f1b": 2, "zbv": 2, "interleaved_zero_bubble": 2}


def count(schedule: Schedule) -> dict[str, Any]:
    """The message counts of one schedule (see the module's docstring)."""
    sends = receives = together = 0
    gaps: list[int] = []
    for _rank, actions in enumerate(schedule.actions):
        computed = 0
        last: dict[int, int] = {}  # peer rank -> computations done at its last send
        for action in actions:
            if action.kind.is_compute:
                computed += 1
            elif not schedule.is_local(action):
                peer = schedule.rank_of(action.peer_stage())
                if action.kind.is_send:
                    sends += 1
                    if peer in last:
                        gaps.append(computed - last[peer])
                    last[peer] = computed
                else:
                    receives += 1
        for _, group in comm_groups(actions):
            peers = [schedule.rank_of(a.peer_stage()) for a in group if a.kind.is_send and not schedule.is_local(a)]
            together += len(peers) - len(set(peers))
    ranks = schedule.num_ranks
    return {
        "sends_per_rank": sends / ranks, "receives_per_rank": receives / ranks,
        "sends_in_a_group_with_another_to_the_same_peer": together,
        "computations_between_sends_min": min(gaps) if gaps else None,
        "computations_between_sends_median": statistics.median(gaps) if gaps else None,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2, help="ranks")
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args()
    print(
        "| schedule | sends per rank | receives per rank | sends sharing a group with another to the same peer | "
        "computations between consecutive sends to a peer (min, median) |"
    )
    print("|---|---|---|---|---|")
    for name, virtual in SCHEDULES.items():
        c = count(build(name, args.stages, args.chunks, virtual))
        print(f"| `{name}` | {c['sends_per_rank']:g} | {c['receives_per_rank']:g} | "
              f"{c['sends_in_a_group_with_another_to_the_same_peer']} | "
              f"{c['computations_between_sends_min']}, {c['computations_between_sends_median']:g} |")  # fmt: skip


if __name__ == "__main__":
    main()
