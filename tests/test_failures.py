"""One rank fails: every rank ends promptly, and what the user reads names the rank and the cause."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_pipe.trainer.failures import PeerFailure, explain, is_communication_error

ROOT = Path(__file__).resolve().parents[1]
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
    import lightning_pipe.trainer.failures as failures

    monkeypatch.setattr(failures, "_WAIT_S", 0.2)
    store = FakeStore({"lightning_pipe/lost/1": "1"})
    text = explain(store, 0, 3, _name, RuntimeError("Connection reset by peer"))
    assert text.startswith("rank 2 (stage 2 of 3) stopped without reporting an error")

    class Gone(FakeStore):
        def set(self, key: str, value: str) -> None:
            raise ConnectionError("store unreachable")

    assert "rank 0 (stage 0 of 3) is gone" in explain(Gone({}), 1, 3, _name, RuntimeError("Connection reset by peer"))


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
        assert f"lightning-pipe: {name} is gone" in result.stderr, result.stderr[-3000:]
    else:  # the script launcher names a dead child itself, or the survivors do
        launcher = (
            f"[rank: {rank}] Child process with PID" in result.stderr and "terminated with code -9" in result.stderr
        )
        assert launcher or f"{name} stopped without reporting an error" in result.stderr, result.stderr[-3000:]
