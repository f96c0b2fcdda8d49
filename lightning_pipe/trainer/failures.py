"""When one rank fails, every rank says which one and why.

A pipeline's ranks wait on each other all the time, so an exception in one stage's code, or a
process that dies, surfaces on the others as an opaque communication error (gloo's ``Connection
reset by peer``, NCCL's collective timeouts) that names neither the rank nor the cause. The
rendezvous store every rank already shares (torch.distributed's default ``TCPStore``) carries a
short note instead: a rank that fails with its own exception writes ``rank r (stage s): Type:
text`` there before it goes down; a rank that fails on communication waits a moment for such a
note and raises an error quoting it. When no note comes (a process killed outright), the ranks
that reported nothing are named as the likely dead.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_pipe.trainer import internals

log = logging.getLogger(__name__)

_NOTE = "lightning_pipe/failed/"
_LOST = "lightning_pipe/lost/"
_WAIT_S = 3.0
_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "GLHF",
    "NCCL",
)


class PeerFailure(RuntimeError):
    """Another rank of the pipeline failed; the message says which and why."""


def is_communication_error(error: BaseException) -> bool:
    """Whether ``error`` is how a peer's failure looks from here, rather than a failure of its own."""
    if isinstance(error, PeerFailure):
        return False
    kinds = tuple(k for k in (getattr(dist, "DistBackendError", None), getattr(dist, "DistNetworkError", None)) if k)
    return isinstance(error, kinds) or any(marker in str(error) for marker in _MARKERS)


def _store() -> Any:
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return internals.default_store()
    except Exception:
        return None


def report(error: BaseException, rank: int, describe_rank: Callable[[int], str]) -> PeerFailure | None:
    """Record this rank's failure for the others, or, for a communication error, explain it with
    theirs. Returns the error to raise instead of ``error`` (None: keep ``error``)."""
    store = _store()
    if store is None:
        return None
    if not is_communication_error(error):
        text = f"{describe_rank(rank)} failed: {type(error).__name__}: {error}"
        with contextlib.suppress(Exception):
            store.set(f"{_NOTE}{rank}", text[:4000])
        return None
    return PeerFailure(explain(store, rank, dist.get_world_size(), describe_rank, error))


def explain(store: Any, rank: int, world_size: int, describe_rank: Callable[[int], str], error: BaseException) -> str:
    """The note of the rank that failed first, or the ranks that went silent."""
    try:
        store.set(f"{_LOST}{rank}", "1")
        deadline = time.monotonic() + _WAIT_S
        while True:
            for other in range(world_size):
                if other != rank and store.check([f"{_NOTE}{other}"]):
                    note = store.get(f"{_NOTE}{other}").decode()
                    return f"{note} ({describe_rank(rank)} stopped because of it: {type(error).__name__})"
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        silent = [r for r in range(world_size) if r != rank and not store.check([f"{_LOST}{r}"])]
    except Exception:  # the store lives in rank 0's process: it went down with it
        return (
            f"{describe_rank(0)} is gone (the rendezvous store in its process does not answer); "
            f"{describe_rank(rank)} lost its connection: {type(error).__name__}: {str(error)[:300]}"
        )
    who = ", ".join(describe_rank(r) for r in silent) or "another rank"
    return (
        f"{who} stopped without reporting an error (killed, out of memory, or crashed outside Python?); "
        f"{describe_rank(rank)} lost its connection to it: {type(error).__name__}: {str(error)[:300]}"
    )


def note(exception: BaseException, rank: int, describe_rank: Callable[[int], str]) -> None:
    """Tell the other ranks why this one fails (:func:`report`), or explain a communication error
    with the note of the rank that failed first, added to ``exception`` (logged on Python 3.10)."""
    explained = report(exception, rank, describe_rank)
    if explained is None:
        return
    message = f"lightning-pipe: {explained}"
    if hasattr(exception, "add_note"):
        exception.add_note(message)
    else:  # Python 3.10
        log.error(message)


__all__ = ["PeerFailure", "explain", "is_communication_error", "note", "report"]


def after_failure(failure: BaseException | None, teardown: Callable[[], None]) -> None:
    """Run ``teardown``. When the run already failed with ``failure``, a failure of the teardown
    itself (Lightning moving a half-built module to the CPU: ``Cannot copy out of meta tensor``) is
    added to ``failure`` as a note instead of replacing it, so the user sees the first error."""
    try:
        teardown()
    except Exception as error:
        if failure is None:
            raise
        if sys.version_info >= (3, 11):  # no notes on Python 3.10: the first error alone
            failure.add_note(f"(tearing down after this error then failed too: {type(error).__name__}: {error})")
