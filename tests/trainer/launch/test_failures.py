"""One rank fails: every rank ends promptly, and what the user reads names the rank and the cause."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_pipe.trainer.launch.failures import PeerFailure, explain, is_communication_error

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tests" / "scripts" / "fail_one_rank.py"
# hang guards, not speed checks: one of these tests took 42 s on a loaded 2-core machine; a rank left waiting
# would wait for the process group's timeout (30 minutes)
pytestmark = pytest.mark.timeout(420)


class FakeStore:
    """The calls of torch.distributed's TCPStore that the failure notes use."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = dict(values)

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key].encode()

    def add(self, key: str, amount: int) -> int:
        self.values[key] = str(int(self.values.get(key, "0")) + amount)
        return int(self.values[key])


def _name(rank: int) -> str:
    return f"rank {rank} (stage {rank} of 3)"


def test_communication_errors_are_told_from_the_users_own() -> None:
    assert is_communication_error(RuntimeError("[pair.cc:537] Read error: Connection reset by peer. GLHF!"))
    assert not is_communication_error(ValueError("boom"))
    assert not is_communication_error(PeerFailure("Connection reset by peer"))


def test_a_peers_note_explains_a_lost_connection() -> None:
    store = FakeStore({"lightning_pipe/failed/2": "rank 2 (stage 2 of 3) failed: ValueError: boom"})
    text = explain(store, 0, 3, _name, RuntimeError("Connection reset by peer"))
    assert text.startswith("rank 2 (stage 2 of 3) failed: ValueError: boom")
    assert store.check(["lightning_pipe/lost/0"])  # and this rank said it lost the connection


def test_without_a_note_the_silent_ranks_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_pipe.trainer.launch.failures as failures

    monkeypatch.setattr(failures, "_WAIT_S", 0.2)
    store = FakeStore({"lightning_pipe/lost/1": "1"})
    text = explain(store, 0, 3, _name, RuntimeError("Connection reset by peer"))
    assert text.startswith("rank 2 (stage 2 of 3) stopped without reporting an error")

    class Gone(FakeStore):
        def set(self, key: str, value: str) -> None:
            raise ConnectionError("store unreachable")

    text = explain(Gone({}), 1, 3, _name, RuntimeError("Connection reset by peer"))
    assert "the rendezvous store in rank 0 (stage 0 of 3)'s process does not answer: that process has ended" in text


def test_a_lost_node_is_named_and_the_living_ranks_are_not() -> None:
    """4 ranks, ranks 2 and 3 on a node that is lost: rank 0 loses its connection first. Rank 1 is alive but
    has not failed yet (it waits on rank 0); only ranks 2 and 3 stopped beating. Before the heartbeat rank 0
    named ranks 1, 2 and 3."""
    from lightning_pipe.trainer.launch.failures import gone_ranks

    before, after = [10, 12, None, None], [16, 18, None, None]  # 2 and 3 never beat since the wait began
    assert gone_ranks(0, [True, False, False, False], before, after) == [2, 3]
    assert gone_ranks(0, [True, False, False, False], [10, 12, 7, 7], [16, 18, 7, 7]) == [2, 3]  # stood still
    assert gone_ranks(1, [True, True, False, False], before, after) == [2, 3]  # rank 1's own view
    assert gone_ranks(0, [True, True, False, True], [10, 12, 7, 7], [16, 18, 7, 7]) == [2]  # 3 reported
    # no heartbeat anywhere (a store without it): every rank that reported nothing, as the best guess
    assert gone_ranks(0, [True, False, False, False], [None] * 4, [None] * 4) == [1, 2, 3]


def test_the_heartbeat_beats_until_its_process_group_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_pipe.trainer.launch.failures as failures

    monkeypatch.setattr(failures, "_BEAT_S", 0.02)
    store, current = FakeStore({}), [None]
    current[0] = store
    beat = failures.Heartbeat(store, 3, current=lambda: current[0]).start()
    deadline = time.monotonic() + 30  # a deadline against a hang on a loaded machine, not a speed check
    while int(store.values.get("lightning_pipe/alive/3", 0)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert int(store.values["lightning_pipe/alive/3"]) >= 3
    current[0] = None  # the process group destroyed: the thread ends and drops the store
    beat._thread.join(2)
    assert not beat._thread.is_alive() and beat.store is None
    assert failures.first_line(RuntimeError("Connection reset by peer\nException raised from recvBytes\nframe #0")) == (
        "Connection reset by peer"
    )


def _run(*args: Any, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run(  # the folder in the command line tells this run's processes apart
        [sys.executable, str(SCRIPT), *map(str, args), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    ended = time.monotonic()
    while _survivors(tmp_path) and time.monotonic() - ended < 60:
        time.sleep(0.5)
    assert not _survivors(tmp_path), "processes left running"
    return result


def _survivors(tmp_path: Path) -> list[str]:
    found = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    return [pid for pid in found if int(pid) != os.getpid()]


@pytest.mark.parametrize("rank", [pytest.param(0, marks=pytest.mark.slow), 1])  # rank 0: with --runslow
def test_an_exception_on_one_stage_reaches_every_rank_with_its_text(tmp_path: Path, rank: int) -> None:
    result = _run(2, rank, "raise", tmp_path=tmp_path)
    assert result.returncode != 0
    other = 1 - rank
    expected = (
        f"[rank{other}]: lightning-pipe: rank {rank} (stage {rank} of 2) failed: ValueError: boom in the user's "
        f"code on rank {rank}"
    )
    assert expected in result.stderr, result.stderr[-3000:]
    assert f"ValueError: boom in the user's code on rank {rank}" in result.stderr


@pytest.mark.parametrize(
    "devices, rank",
    [pytest.param(2, 0, marks=pytest.mark.slow), pytest.param(2, 1, marks=pytest.mark.slow), (4, 2)],
    ids=["first", "last", "middle"],
)
def test_a_killed_stage_ends_every_process_and_is_named(tmp_path: Path, devices: int, rank: int) -> None:
    result = _run(devices, rank, "kill", tmp_path=tmp_path)
    assert result.returncode != 0
    name = f"rank {rank} (stage {rank} of {devices})"
    if rank == 0:  # the process holding the rendezvous store is gone; the others say so
        assert f"lightning-pipe: the rendezvous store in {name}'s process does not answer" in result.stderr, (
            result.stderr[-3000:]
        )
    else:  # the script launcher names a dead child itself, or the survivors do
        launcher = (
            f"[rank: {rank}] Child process with PID" in result.stderr and "terminated with code -9" in result.stderr
        )
        assert launcher or f"{name} stopped without reporting an error" in result.stderr, result.stderr[-3000:]
        # a survivor names the dead rank alone: not the living ranks that had not failed yet (before each rank
        # beat a counter in the store, a rank still waiting on a peer was named too)
        named = re.findall(r"lightning-pipe: (.*?) stopped without reporting an error", result.stderr)
        assert all(n == name for n in named), named
