"""When one rank fails, every rank says which one and why.

A pipeline's ranks wait on each other all the time, so an exception in one stage's code, or a
process that dies, surfaces on the others as an opaque communication error (gloo's ``Connection
reset by peer``, NCCL's collective timeouts) that names neither the rank nor the cause. The
rendezvous store every rank already shares (torch.distributed's default ``TCPStore``) carries a
short note instead: a rank that fails with its own exception writes ``rank r (stage s): Type:
text`` there before it goes down; a rank that fails on communication waits a moment for such a
note and raises an error quoting it. When no note comes (a process killed outright, a node lost),
the ranks that are gone are named: every rank beats a counter in the store (:class:`Heartbeat`, from
a thread, so a rank blocked in a collective still beats), and a rank whose counter stood still over
the wait, and that reported no lost connection either, is gone. A rank that is alive but not yet
failed (waiting on a peer that waits on the lost ones) is not blamed.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from lightning_pipe.trainer import internals

log = logging.getLogger(__name__)

_NOTE = "lightning_pipe/failed/"
_LOST = "lightning_pipe/lost/"
_ALIVE = "lightning_pipe/alive/"
_WAIT_S = 3.0
_BEAT_S = 0.5  # well inside _WAIT_S: a living rank beats several times while another waits for notes
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


class Heartbeat:
    """Adds 1 to this rank's counter in the store every ``_BEAT_S`` seconds, from a daemon thread, for as
    long as ``store`` is the default process group's: :func:`explain` tells a gone rank (its counter
    stands still) from a living one that has not failed yet. Ends by itself once the process group is
    destroyed (then it drops the store, which in rank 0's process holds the server)."""

    def __init__(self, store: Any, rank: int, current: Callable[[], Any] = lambda: _store()) -> None:
        self._store, self._key, self._current = store, f"{_ALIVE}{rank}", current
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning-pipe-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    @property
    def store(self) -> Any:
        """The store it beats on; None once it stopped beating there."""
        return self._store

    def stop(self, wait: float = 0.0) -> None:
        """Stop beating; with ``wait``, wait up to that many seconds for the thread to end."""
        self._stop.set()
        if wait and self._thread.is_alive():
            self._thread.join(wait)

    def _run(self) -> None:
        try:
            while self._current() is self._store:
                self._store.add(self._key, 1)
                if self._stop.wait(_BEAT_S):
                    break
        except Exception:  # the store went away (its host ended): nothing more to beat
            pass
        self._store = None


_heartbeat: Heartbeat | None = None


def start_heartbeat(rank: int) -> None:
    """Start this rank's :class:`Heartbeat` on the default process group's store (once per process group)."""
    global _heartbeat
    store = _store()
    if store is None or (_heartbeat is not None and _heartbeat.store is store):
        return
    if _heartbeat is not None:
        _heartbeat.stop()
    else:  # a beat must not be under way while the interpreter ends: torch aborts the process if it then fails
        atexit.register(_stop_at_exit)
    _heartbeat = Heartbeat(store, rank).start()


def _stop_at_exit() -> None:
    if _heartbeat is not None:
        _heartbeat.stop(wait=2.0)


def _beats(store: Any, world_size: int) -> list[int | None]:
    """Every rank's heartbeat count (None: it never beat)."""
    return [int(store.get(f"{_ALIVE}{r}")) if store.check([f"{_ALIVE}{r}"]) else None for r in range(world_size)]


def gone_ranks(
    rank: int, reported: Sequence[bool], before: Sequence[int | None], after: Sequence[int | None]
) -> list[int]:
    """The ranks to name as gone, seen from ``rank`` after waiting for the others' notes: those that neither
    reported a lost connection (``reported``) nor beat during the wait (``before`` and ``after``: their
    heartbeat counts at its start and end). Where no rank beats at all (no heartbeat running), every rank
    that reported nothing is named, as the best guess left."""
    beating = any(b is not None for b in after)
    return [
        r
        for r in range(len(reported))
        if r != rank and not reported[r] and not (beating and after[r] is not None and after[r] != before[r])
    ]


def first_line(error: BaseException, limit: int = 300) -> str:
    """The error's first line: a gloo or NCCL error's text goes on with pages of C++ frames."""
    text = str(error).strip()
    return (text.splitlines()[0] if text else "")[:limit]


def explain(store: Any, rank: int, world_size: int, describe_rank: Callable[[int], str], error: BaseException) -> str:
    """The note of the rank that failed first, or the ranks that are gone."""
    lost = f"{describe_rank(rank)} lost its connection to it: {type(error).__name__}: {first_line(error)}"
    try:
        store.set(f"{_LOST}{rank}", "1")
        before = _beats(store, world_size)
        deadline = time.monotonic() + _WAIT_S
        while True:
            for other in range(world_size):
                if other != rank and store.check([f"{_NOTE}{other}"]):
                    note = store.get(f"{_NOTE}{other}").decode()
                    return f"{note} ({describe_rank(rank)} stopped because of it: {type(error).__name__})"
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        reported = [store.check([f"{_LOST}{r}"]) for r in range(world_size)]
        gone = gone_ranks(rank, reported, before, _beats(store, world_size))
    except Exception:  # the store does not answer: the process that holds it (rank 0's) has ended
        return (
            f"the rendezvous store in {describe_rank(0)}'s process does not answer: that process has ended (it may "
            f"have failed on a lost connection too, and its message names the ranks that are gone); "
            f"{describe_rank(rank)} lost its connection: {type(error).__name__}: {first_line(error)}"
        )
    if not gone:
        return f"no rank is gone (every other one still runs, or lost its connection too); {lost}"
    who = ", ".join(describe_rank(r) for r in gone)
    why = "killed, out of memory, its node lost, or crashed outside Python?"
    return f"{who} stopped without reporting an error ({why}); {lost}"


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
