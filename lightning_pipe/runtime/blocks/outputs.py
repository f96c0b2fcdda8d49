"""Blocks that hand later blocks more than their hidden state, refused when first seen.

Between the stages of a block container (:mod:`lightning_pipe.runtime.blocks.container`) only what a block
is called with first (its hidden state) travels; everything else a block gets must be recomputable
from the micro-batch on every stage. T5's blocks break that: block 0 computes the relative position
bias and returns it beside the hidden state, and the loop gives it to every later block
(``hidden, position_bias, _ = block(hidden, mask, position_bias, ...)``). On the stage holding
block 0 the bias would stay behind; on the later stages the stand-ins of earlier blocks return the
hidden state alone, and the loop fails to unpack it (``not enough values to unpack``), or worse,
unpacks a tensor's rows. So, in the first micro-batch's forward, before any backward or optimizer
step:

- the stage whose blocks produced such a value refuses when the next stage's first block is called
  with it, naming the block, the argument and the block that returned it;
- a stage whose model fails after a stand-in of another stage's block returned (and before its own
  blocks ran) says so, with the model's own error.

What the last block before a boundary returns beside its hidden state and the next block is called
with crosses under the schedules that carry values (:class:`lightning_pipe.runtime.crossing.carried.Returned`): the
stand-ins of earlier blocks return it in the block's structure. The checks above remain for the
other schedules and for values that the last block does not hand on.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn

from lightning_pipe.runtime.blocks.reads import HeldBlockRead
from lightning_pipe.runtime.crossing.carried import CARRYING_SCHEDULES

ALTERNATIVE = (
    "Beside a block's hidden state (its first argument), what the last block before a stage boundary returns for "
    f"later blocks (T5's position biases) crosses stages under the schedules that carry values with their "
    f"micro-batch ({', '.join(sorted(CARRYING_SCHEDULES))}) only, and a value an earlier block returned that the "
    "last one does not hand on never does. Choose one of those schedules, or express the model as an nn.Sequential "
    "whose layers take and return a tuple of tensors (the hidden state and what later layers need: a tuple crosses "
    "stages) and name it with PipelineStrategy(module=...)."
)


def argument_names(block: nn.Module) -> list[str]:
    """The names of ``block.forward``'s parameters, in order (for naming what a block was passed)."""
    try:
        return list(inspect.signature(block.forward).parameters)
    except (TypeError, ValueError):
        return []


class BlockOutputsRefused(RuntimeError):
    """A value a block returned beside its hidden state would have to cross a stage boundary."""


class BlockOutputs:
    """The tensors this stage's blocks returned beside their hidden state during one micro-batch's
    pass (kept referenced, so their ``id`` cannot be reused meanwhile), and the last stand-in that
    returned before this stage's blocks ran."""

    def __init__(self) -> None:
        self._extra: dict[int, tuple[int, int, int, Tensor]] = {}
        self.skipped: tuple[int, str] | None = None  # (index, kind) of the last stand-in called

    def returned(self, index: int, output: Any, args: tuple = (), kwargs: dict | None = None) -> None:
        """Block ``index``, called with ``args``/``kwargs``, returned ``output``: remember its tensors other
        than the first that it made (not those it was given and hands back: a value computed before the
        loop that every block passes on is computed on every stage)."""
        self.skipped = None
        if not isinstance(output, (tuple, list)) or len(output) < 2:
            return
        given = {id(v) for v in (*args, *(kwargs or {}).values()) if isinstance(v, Tensor)}
        for position, value in enumerate(output[1:], start=1):
            if isinstance(value, Tensor) and id(value) not in given:
                self._extra[id(value)] = (index, position, len(output), value)

    def check_boundary(
        self, index: int, kind: str, names: list[str], args: tuple, kwargs: dict, crossing: set[int] | None = None
    ) -> None:
        """The next stage's first block ``index`` is called with ``args``/``kwargs`` (the first positional
        one, or the hidden-state keyword, being what crosses): refuse when another of them is a tensor an
        earlier block returned beside its hidden state and that does not cross (``crossing``: the ids of
        those the last block returned, which do, :class:`~lightning_pipe.runtime.crossing.carried.Returned`)."""
        passed = [(names[i] if i < len(names) else f"argument {i}", v) for i, v in enumerate(args)][1:] if args else []
        hidden = names[0] if names else None
        passed += [(k, v) for k, v in kwargs.items() if args or k != hidden]
        for name, value in passed:
            found = (
                self._extra.get(id(value)) if isinstance(value, Tensor) and id(value) not in (crossing or ()) else None
            )
            if found is not None and found[3] is value:
                source, position, count = found[:3]
                raise BlockOutputsRefused(
                    f"Block {index} ({kind}), the first of the next pipeline stage, is called with {name!r}, a tensor "
                    f"of shape {list(value.shape)} that block {source} returned beside its hidden state (output "
                    f"{position} of {count}). {ALTERNATIVE}"
                )

    def explain(self, error: BaseException) -> BlockOutputsRefused | None:
        """Where the model failed after a stand-in of another stage's block returned only the hidden
        state, and before this stage's blocks ran: the error that says why it probably failed."""
        if self.skipped is None or isinstance(error, (BlockOutputsRefused, HeldBlockRead)):
            return None
        index, kind = self.skipped
        return BlockOutputsRefused(
            f"The model's forward failed right after block {index} ({kind}), which another pipeline stage holds: here "
            "it is passed over and returns only its hidden state, and if the model's loop expects more from it (a "
            f"tuple: the hidden state beside values for later blocks), it fails so: {type(error).__name__}: {error}. "
            f"{ALTERNATIVE}"
        )
