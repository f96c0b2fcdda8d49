"""Values that blocks record for the last stage, carried with the micro-batch beside the hidden state.

A Hugging Face MoE model with ``output_router_logits=True`` (Mixtral, Qwen2-MoE ...) records every
block's router logits with forward hooks while its forward runs, and its loss on the last stage
reads all of them (the load-balancing loss). Under ``module=`` a block container, the blocks of
other stages do not run on a stage (:mod:`lightning_pipe.runtime.blocks`), so:

- each stage notes what its own blocks recorded (:meth:`Carry.record`), and sends it on after the
  hidden state, with what it received for earlier blocks: the next stage's sends hold the values of
  every block before it;
- a stand-in of an earlier stage's block, called while the model records, hands the model's
  collector that block's received values, in the block's place (:meth:`Carry.feed`), so the
  model's own loss sees every block's values in the unsplit model's order;
- the received values are leaves like the hidden state: their gradients go back with the hidden
  state's, to the stage whose blocks recorded them, whose router weights they reach.

What crosses is decided from each micro-batch's forward and told by the activation header (per
earlier block, how many values it recorded: ``carried``), so a stage learns it from the first
micro-batch of each shape. Only ``router_logits`` are carried; other recordings stay refused
(:mod:`lightning_pipe.runtime.block_reads`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from lightning_pipe.schedules.traits import TRAITS, traits
from lightning_pipe.torch_internals import hf_active_output_collector

#: the recording carried between stages
CARRIED_KEY = "router_logits"

#: the schedules under which carried values were proven to train as plain training does (the traits' column)
CARRYING_SCHEDULES = frozenset(name for name, t in TRAITS.items() if t.carries_records)


def carrying_refusal(schedule: str) -> str | None:
    """Why values recorded by blocks cannot be carried between stages under ``schedule`` (None: they can)."""
    if traits(schedule).carries_records:
        return None
    return (
        f"schedule={schedule!r} does not carry them yet (only {', '.join(sorted(CARRYING_SCHEDULES))} do: their "
        "micro-batches pass the stages as one chain, with one weight version); choose one of those"
    )


def recorded_list() -> list[Tensor] | None:
    """The list the model is recording router logits into right now, or None when it is not."""
    collected = hf_active_output_collector()
    if not collected or CARRIED_KEY not in collected:
        return None
    return collected[CARRIED_KEY]


class Carry:
    """The carried values of one micro-batch on one stage (blocks ``start`` to ``stop``).

    Args:
        start: the stage's first block.
        received: the values received for blocks ``0..start-1`` (one list per block), or None when the
            previous stage carried nothing (or this is the first stage).
    """

    def __init__(self, start: int, received: list[list[Tensor]] | None) -> None:
        self.start = start
        self.received = received
        self.own: dict[int, list[Tensor]] = {}
        self.recording = False

    @staticmethod
    def split(tensors: Sequence[Tensor], counts: Sequence[int]) -> tuple[list[Tensor], list[list[Tensor]] | None]:
        """Received ``tensors``: the hidden state's and, per earlier block, its carried values."""
        total = sum(counts)
        if not counts:
            return list(tensors), None
        hidden, rest = list(tensors[: len(tensors) - total]), list(tensors[len(tensors) - total :])
        per_block, at = [], 0
        for count in counts:
            per_block.append(rest[at : at + count])
            at += count
        return hidden, per_block

    def record(self, index: int, before: int) -> None:
        """Block ``index`` of this stage ran; the model's recording list had ``before`` entries then."""
        recorded = recorded_list()
        if recorded is None:
            return
        self.recording = True
        self.own[index] = list(recorded[before:])

    def feed(self, index: int) -> bool:
        """Stand-in of earlier block ``index``, called while the model records router logits: put the
        values received for it into the model's recording; False when none were received for it."""
        recorded = recorded_list()
        if recorded is None or self.received is None or index >= len(self.received):
            return False
        recorded.extend(self.received[index])
        return True

    def outgoing(self, hidden: Sequence[Tensor], stop: int) -> tuple[list[Tensor], tuple[int, ...]]:
        """What this stage sends on, having run blocks up to ``stop``: the hidden state's tensors, then
        every earlier block's carried values, and per block how many (empty when nothing records)."""
        if not self.recording and self.received is None:
            return list(hidden), ()
        received = self.received if self.received is not None else [[] for _ in range(self.start)]
        per_block = [*received, *(self.own.get(i, []) for i in range(self.start, stop))]
        return [*hidden, *(t for values in per_block for t in values)], tuple(len(v) for v in per_block)


__all__ = ["CARRIED_KEY", "CARRYING_SCHEDULES", "Carry", "carrying_refusal", "recorded_list"]
