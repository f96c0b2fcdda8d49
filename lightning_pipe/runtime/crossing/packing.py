"""How one message's flat tensors make a stage's value again (a leaf module: the transport's headers carry it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Packing:
    """How one message's flat tensors make a stage's value again: ``was_tuple`` (the hidden state was a
    tuple), and ``recorded``, per earlier block the counts of the recorded values after the hidden state."""

    was_tuple: bool = False
    recorded: tuple[int, ...] = ()


#: a single tensor with nothing recorded after it (a gradient's message, a plain stage's output)
SINGLE = Packing()
