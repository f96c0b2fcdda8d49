"""Where the weight-gradient products of a split backward wait for their W action.

Zero-bubble schedules split a micro-batch's backward into B (the input gradient, which the
previous stage waits for) and W (the weight gradients, which fill the bubble). As in the
zero-bubble implementation for Megatron-LM (its ``WeightGradStore``), B is one ordinary autograd
backward in which the layers that know how to (plain ``nn.Linear`` and ``nn.Conv1d/2d/3d``, see
:mod:`lightning_pipe.runtime.grads.fused_linear` and :mod:`lightning_pipe.runtime.grads.deferred_conv`)
compute only their input gradient and hand over a closure for their weight gradient; W runs
those closures. Nothing is computed twice and no graph is kept from B to W: W keeps only each
layer's input and output gradient. Other parameters (norms, embeddings, computed weights) get
their gradients in B, as autograd gives them.

Outside :func:`deferring` the layers run their weight-gradient work at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: One layer's weight-gradient work for one micro-batch: accumulates into ``.grad``.
WeightWork = Callable[[], None]

_store: list[WeightWork] | None = None


@contextmanager
def deferring() -> Iterator[list[WeightWork]]:
    """Collect, instead of running, the weight-gradient work of the backwards run inside."""
    global _store
    previous, _store = _store, []
    try:
        yield _store
    finally:
        _store = previous


def defer_or_run(work: WeightWork) -> None:
    """Keep ``work`` for W while :func:`deferring` is active, else run it now."""
    if _store is None:
        work()
    else:
        _store.append(work)


def run(works: list[WeightWork]) -> None:
    """W: run a micro-batch's weight-gradient work, in the order B collected it."""
    for work in works:
        work()
