"""Values that blocks record for the last stage, carried with the micro-batch beside the hidden state.

A Hugging Face model (transformers 5) records values of its blocks with forward hooks while its
forward runs, and code after the loop reads all of them: an MoE model's router logits
(``output_router_logits=True``, for its load-balancing loss), every layer's hidden state
(``output_hidden_states=True``: pooling the last 4 layers' [CLS], a probe on an intermediate layer,
Wav2Vec2's and HuBERT's ``use_weighted_layer_sum``), attention and cross-attention weights
(``output_attentions=True``).
Under ``module=`` a block container, the blocks of other stages do not run on a stage
(:mod:`lightning_pipe.runtime.blocks.container`), so:

- each stage notes what its own blocks recorded (:meth:`Carry.record`), and sends it on after the
  hidden state, with what it received for earlier blocks: the next stage's sends hold the values of
  every block before it;
- a stand-in of an earlier stage's block, called while the model records, hands the model's
  collector that block's received values, in the block's place (:meth:`Carry.feed`), so the
  model's own code sees every block's values in the unsplit model's order;
- the received values are leaves like the hidden state: their gradients go back with the hidden
  state's, to the stage whose blocks recorded them.

What crosses is decided from each micro-batch's forward and told by the activation header: per
earlier block and per key of :data:`CARRIED_KEYS`, one integer (:func:`entry_code`) that says how
many entries the block recorded and which of them are tensors (transformers records ``None`` for
hidden states that ``output_hidden_states=[-4, -3, -2, -1]`` does not select: nothing is sent for
those). A stage learns it from the first micro-batch of each shape. Other recordings (a model's
own keys) stay refused (:mod:`lightning_pipe.runtime.blocks.reads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from lightning_pipe.runtime.crossing.forced_outputs import forced_read, forced_unread
from lightning_pipe.schedules.traits import TRAITS, ScheduleTraits
from lightning_pipe.torch_internals import hf_active_output_collector

#: the recordings carried between stages, in the order the header gives them per block
CARRIED_KEYS = ("hidden_states", "attentions", "cross_attentions", "router_logits")

#: how messages name each recording and the setting that turns it on
DESCRIBED = {
    "hidden_states": "the hidden states of every block (output_hidden_states=True)",
    "attentions": "the attention weights of every block (output_attentions=True)",
    "cross_attentions": "the cross-attention weights of every block (output_attentions=True)",
    "router_logits": "the router logits of every block for its MoE load-balancing loss (output_router_logits=True)",
}

#: the schedules under which carried values were proven to train as plain training (or the rule's reference)
#: does: the traits' ``records_cross`` column, every built-in schedule
CARRYING_SCHEDULES = frozenset(name for name, t in TRAITS.items() if t.records_cross)

#: what one block recorded: per carried key, its entries (None where transformers recorded None)
Entries = dict[str, list[Tensor | None]]


def carrying_refusal(schedule: ScheduleTraits) -> str | None:
    """Why values recorded by blocks cannot be carried between stages under ``schedule`` (None: they can).
    The values belong to their micro-batch and travel with it under every schedule; a schedule given as
    text has not been run with them (its order is the user's), so it refuses them."""
    if schedule.records_cross:
        return None
    return (
        f"schedule {schedule.label} does not carry them yet (a schedule given as text has not been checked to carry "
        f"them); choose one of the built-in schedules ({', '.join(sorted(CARRYING_SCHEDULES))}), which do"
    )


def carrying_refused(keys: list[str], reason: str, where: str) -> str:
    """The message refusing recorded values ``keys`` that cannot cross stages, for ``reason``."""
    forced = forced_read(["hidden_states"]) if "hidden_states" in keys else ""
    what = " and ".join(DESCRIBED[k] for k in keys)
    flags = " and ".join(sorted({f"output_{k.removeprefix('cross_')}=False" for k in keys}))
    otherwise = (
        f"Otherwise set {flags} (in the call and in model.config): the model then trains without them, as it would "
        "without the pipeline with that setting."
        if not forced
        else "Otherwise change the model's configuration as said."
    )
    return (
        f"The model records {what}{f' ({forced})' if forced else ''}, but {where} and they cannot reach the stage "
        f"that reads them: {reason}. {otherwise}"
    )


def carried_recording() -> dict[str, list[Tensor | None]]:
    """The lists the model is recording carried values into right now, by key (empty when it records
    none). Hidden states that transformers records for a forward that never reads them (Wav2Vec2's
    classifier without its layer sum: :mod:`.forced_outputs`) are left out: nothing would read them."""
    collected = hf_active_output_collector() or {}
    keys = [k for k in CARRIED_KEYS if k in collected]
    if "hidden_states" in keys and forced_unread():
        keys.remove("hidden_states")
    return {k: collected[k] for k in keys}


def entry_code(entries: Sequence[Tensor | None]) -> int:
    """One integer for a block's entries under one key: a leading 1 bit, then bit ``i`` set where
    entry ``i`` is a tensor (``1``: no entries; ``0b111``: two tensors)."""
    code = 1 << len(entries)
    for i, entry in enumerate(entries):
        code |= int(entry is not None) << i
    return code


def entry_slots(code: int) -> list[bool]:
    """Inverse of :func:`entry_code`: per entry, whether it is a tensor."""
    return [bool(code >> i & 1) for i in range(code.bit_length() - 1)]


def crossing_line(stage: int, tensors: Sequence[Tensor], codes: Sequence[int]) -> str:
    """The line a run prints once, from the first micro-batch that carries recorded values: what
    ``stage`` sends on beside the hidden state (``tensors``: all it sends; ``codes``: per block and
    key, :func:`entry_code`), per key and in bytes per micro-batch."""
    slots = [entry_slots(code) for code in codes]
    carried = list(tensors[len(tensors) - sum(sum(s) for s in slots) :])
    per_key = {k: sum(sum(s) for s in slots[i :: len(CARRIED_KEYS)]) for i, k in enumerate(CARRIED_KEYS)}
    parts = [f"{k} ({n} tensor{'s' if n != 1 else ''})" for k, n in per_key.items() if n]
    size = sum(t.numel() * t.element_size() for t in carried)
    return (
        f"lightning-pipe: stage {stage} sends on with each micro-batch, beside the hidden state, what the model "
        f"records of blocks 0..{len(slots) // len(CARRIED_KEYS) - 1}: {', '.join(parts)}, {size} bytes"
    )


def split_codes(codes: Sequence[int], blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A received header's codes: those of the ``blocks`` earlier blocks (per key), and after them,
    where a block returned values for later blocks (:class:`Returned`), ``(length, *positions)``."""
    at = blocks * len(CARRIED_KEYS) if codes else 0
    return tuple(codes[:at]), tuple(codes[at:])


class Returned:
    """What the last block before a stage boundary returned beside its hidden state: the values the next
    block is called with (T5's position biases: ``hidden, position_bias, _ = block(...)``), sent after the
    hidden state and the recorded values, and the structure of the block's output (a tuple of ``length``).
    On the next stages every stand-in of an earlier block returns that structure: the received tensors at
    ``positions``, its hidden state at 0 and, at ``held`` (the other tensors the block returned, which do not
    cross: Swin's feature map before downsampling), the same held value, refused wherever it is read; None
    elsewhere. So the model's loop unpacks what it unpacks from the block (``hidden, reshaped, _ = stage(...)``)
    and hands the values for later blocks on unchanged."""

    def __init__(
        self, length: int = 0, positions: Sequence[int] = (), tensors: Sequence[Tensor] = (), held: Sequence[int] = ()
    ) -> None:
        self.length, self.positions, self.tensors = length, tuple(positions), list(tensors)
        self.held = tuple(held)

    @classmethod
    def received(cls, shape: Sequence[int], tensors: Sequence[Tensor]) -> Returned:
        """From a header's codes (:meth:`codes`: the held positions negative) and the tensors that crossed."""
        if not shape:
            return cls()
        return cls(shape[0], [p for p in shape[1:] if p > 0], tensors, [-p for p in shape[1:] if p < 0])

    @staticmethod
    def count(shape: Sequence[int]) -> int:
        """How many tensors cross for a header's codes ``shape``."""
        return sum(1 for p in shape[1:] if p > 0)

    @classmethod
    def of(cls, output: Any, args: tuple, kwargs: dict) -> Returned:
        """What of ``output`` (the last block's) the next block's call ``args``/``kwargs`` passes on."""
        if not isinstance(output, (tuple, list)) or len(output) < 2:
            return cls()
        passed = {id(v) for v in (*args[1:], *kwargs.values()) if isinstance(v, Tensor)}
        found = [(p, v) for p, v in enumerate(output[1:], start=1) if isinstance(v, Tensor) and id(v) in passed]
        held = [p for p, v in enumerate(output[1:], start=1) if isinstance(v, Tensor) and id(v) not in passed]
        return cls(len(output), [p for p, _ in found], [v for _, v in found], held)

    def standing_in(self, hidden: Any) -> Any:
        """What a stand-in of an earlier block returns: ``hidden`` alone, or the block's structure."""
        if not self.length:
            return hidden
        values: list[Any] = [None] * self.length
        values[0] = hidden
        for position in self.held:
            values[position] = hidden
        for position, tensor in zip(self.positions, self.tensors):
            values[position] = tensor
        return tuple(values)

    def codes(self) -> tuple[int, ...]:
        return (self.length, *self.positions, *(-p for p in self.held)) if self.length else ()

    def line(self, stage: int, block: int) -> str:
        """The line a run prints once: what ``stage`` sends on for the next stage's first ``block``."""
        size = sum(t.numel() * t.element_size() for t in self.tensors)
        return (
            f"lightning-pipe: stage {stage} sends on with each micro-batch, beside the hidden state, what block "
            f"{block - 1} returns for block {block}: outputs {', '.join(map(str, self.positions))} of {self.length} "
            f"({len(self.tensors)} tensor{'s' if len(self.tensors) != 1 else ''}), {size} bytes"
        )


class Carry:
    """The carried values of one micro-batch on one stage (blocks ``start`` to ``stop``).

    Args:
        start: the stage's first block.
        received: the values received for blocks ``0..start-1`` (per block, per key), or None when the
            previous stage carried nothing (or this is the first stage).
    """

    def __init__(self, start: int, received: list[Entries] | None) -> None:
        self.start = start
        self.received = received
        self.own: dict[int, Entries] = {}
        self.recording = False

    @staticmethod
    def split(tensors: Sequence[Tensor], codes: Sequence[int]) -> tuple[list[Tensor], list[Entries] | None]:
        """Received ``tensors``: the hidden state's and, per earlier block, its carried values
        (``codes``: per block, per key of :data:`CARRIED_KEYS`, an :func:`entry_code`)."""
        if not codes:
            return list(tensors), None
        slots = [entry_slots(code) for code in codes]
        total = sum(sum(s) for s in slots)
        hidden, rest = list(tensors[: len(tensors) - total]), iter(tensors[len(tensors) - total :])
        per_block: list[Entries] = []
        for at in range(0, len(slots), len(CARRIED_KEYS)):
            entries: Entries = {}
            for key, present in zip(CARRIED_KEYS, slots[at : at + len(CARRIED_KEYS)]):
                entries[key] = [next(rest) if p else None for p in present]
            per_block.append(entries)
        return hidden, per_block

    @staticmethod
    def lengths() -> dict[str, int]:
        """How many entries the model's carried recordings hold now (before a block runs)."""
        return {k: len(v) for k, v in carried_recording().items()}

    def record(self, index: int, before: dict[str, int]) -> None:
        """Block ``index`` of this stage ran; the model's recordings had ``before`` entries then."""
        recorded = carried_recording()
        if not recorded:
            return
        self.recording = True
        self.own[index] = {k: list(v[before.get(k, 0) :]) for k, v in recorded.items()}

    def feed(self, index: int) -> bool:
        """Stand-in of earlier block ``index``, called while the model records carried values: put the
        values received for it into the model's recordings; False when none were received for it."""
        recorded = carried_recording()
        if not recorded or self.received is None or index >= len(self.received):
            return False
        for key, values in recorded.items():
            values.extend(self.received[index].get(key, []))
        return True

    def outgoing(self, hidden: Sequence[Tensor], stop: int) -> tuple[list[Tensor], tuple[int, ...]]:
        """What this stage sends on, having run blocks up to ``stop``: the hidden state's tensors, then
        every earlier block's carried values, and per block and key its :func:`entry_code` (empty when
        nothing records)."""
        if not self.recording and self.received is None:
            return list(hidden), ()
        received = self.received if self.received is not None else [{} for _ in range(self.start)]
        per_block = [*received, *(self.own.get(i, {}) for i in range(self.start, stop))]
        tensors, codes = list(hidden), []
        for entries in per_block:
            for key in CARRIED_KEYS:
                values = entries.get(key, [])
                codes.append(entry_code(values))
                tensors += [t for t in values if t is not None]
        if all(code == 1 for code in codes):  # nothing recorded (codes received for a block's returned structure)
            return list(hidden), ()
        return tensors, tuple(codes)

    def keys(self) -> list[str]:
        """The keys this stage sends values of (for messages and the first micro-batch's line)."""
        blocks = [*(self.received or []), *self.own.values()]
        return [k for k in CARRIED_KEYS if any(any(t is not None for t in b.get(k, [])) for b in blocks)]
