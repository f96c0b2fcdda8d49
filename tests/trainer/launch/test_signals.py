"""SIGTERM and a dying process end every process of a pipeline promptly (lightning_pipe/trainer/launch/signals.py)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest

from lightning_pipe.trainer.launch.signals import STOPPED_STATUS
from tests.models import TinyNet, loader
from tests.pipeline import pipeline_trainer

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(300)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids: list[int], timeout: float, poll: Any = None) -> list[int]:
    """The pids still running after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if poll is not None:
            poll()
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def _sigterm_rounds(tmp_path: Path, rounds: int, concurrent: int) -> None:
    """Start ``concurrent`` 2-stage jobs at a time (the script launcher, as ``python train.py``), send
    SIGTERM to each (the process the user started) at a random moment of its training and check by
    PID that both of its processes are gone within 30 s, having stopped together."""
    rng = random.Random(17)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)  # each job finds its own free port
    script = ROOT / "tests" / "scripts" / "until_terminated.py"
    failures: list[str] = []
    for first in range(0, rounds, concurrent):
        jobs = {}
        for i in range(first, min(rounds, first + concurrent)):
            out = tmp_path / str(i)
            out.mkdir()
            with open(out / "stderr", "w") as log:
                jobs[i] = (out, subprocess.Popen([sys.executable, str(script), str(out)], cwd=out, env=env,
                                                 stdout=subprocess.DEVNULL, stderr=log))  # fmt: skip
        start = time.monotonic()
        while not all((out / f"pid-{r}").is_file() for out, _ in jobs.values() for r in range(2)):
            for i, (out, job) in jobs.items():
                assert job.poll() is None, f"job {i} ended before training: {(out / 'stderr').read_text()[-3000:]}"
            assert time.monotonic() - start < 120, "the jobs did not start training"
            time.sleep(0.05)
        time.sleep(0.05)  # the pid files are there; let their content land
        pids = {i: [int((out / f"pid-{r}").read_text()) for r in range(2)] for i, (out, _) in jobs.items()}
        moments = sorted((rng.uniform(0.0, 2.0), i) for i in jobs)
        begin = time.monotonic()
        for moment, i in moments:
            time.sleep(max(0.0, begin + moment - time.monotonic()))
            jobs[i][1].send_signal(signal.SIGTERM)
        for moment, i in moments:
            out, job = jobs[i]
            left = wait_gone(pids[i], begin + moment + 30.0 - time.monotonic(), poll=job.poll)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            if left:
                failures.append(f"job {i}: {left} still running 30 s after SIGTERM; {out / 'stderr'}")
                continue
            stopped = [
                (out / f"stopped-{r}").read_text() if (out / f"stopped-{r}").is_file() else None for r in range(2)
            ]
            if job.wait(5) != STOPPED_STATUS or stopped != ["SIGTERMException"] * 2:
                failures.append(f"job {i}: exit status {job.returncode}, stopped with {stopped}; {out / 'stderr'}")
                continue
            # one line, from rank 0, says where it stopped and what it saved
            lines = [line for line in (out / "stderr").read_text().splitlines() if "stopped by SIGTERM" in line]
            said = re.fullmatch(SUMMARY, lines[0]) if len(lines) == 1 else None
            if (
                said is None
                or (said["path"] and not Path(said["path"]).exists())
                or (
                    said["path"] is None and int(said["steps"]) >= 2  # saved every 2 steps
                )
            ):
                failures.append(f"job {i}: the summary lines {lines} do not tell what was saved; {out / 'stderr'}")
            # nothing a user cannot act on: Lightning's sync_dist advice for val_loss (moot under the pipeline)
            # and torch's LeafSpec deprecation that Lightning's CombinedLoader raised once per rank
            noise = [w for w in ("sync_dist=True", "LeafSpec") if w in (out / "stderr").read_text()]
            if noise:
                failures.append(f"job {i}: warnings {noise} in {out / 'stderr'}")
    assert not failures, "\n".join(failures)


SUMMARY = (
    r"lightning-pipe: stopped by SIGTERM during (training|validation) after (?P<steps>\d+) steps \(epoch \d+\); "
    r"(the last checkpoint saved is (?P<path>\S+) \(resume from it\)|no checkpoint was saved .*); exit status 143\."
)


def test_sigterm_ends_a_two_stage_job(tmp_path: Path) -> None:
    _sigterm_rounds(tmp_path, rounds=1, concurrent=4)  # 20 rounds: --runslow


@pytest.mark.slow
def test_sigterm_ends_a_two_stage_job_20_times(tmp_path: Path) -> None:
    _sigterm_rounds(tmp_path, rounds=20, concurrent=5)


class DieAt(L.Callback):
    """Records each rank's pid; rank ``rank`` kills itself (SIGKILL) at batch ``batch``."""

    def __init__(self, out: str, rank: int, batch: int) -> None:
        self.out, self.rank, self.batch = out, rank, batch

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        Path(self.out, f"pid-{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank == self.rank and batch_idx == self.batch:
            Path(self.out, "died").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("dying", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_spawn_survivors_exit_when_a_rank_dies(tmp_path: Path, dying: int) -> None:
    """With ``start_method="spawn"``, torch's launcher sends SIGTERM to the survivors when a process
    dies; they must not wait in a collective with the dead one."""
    trainer = pipeline_trainer(2, start_method="spawn", callbacks=[DieAt(str(tmp_path), dying, 3)], max_steps=10**9)
    with pytest.raises(Exception, match="terminated with signal SIGKILL"):
        trainer.fit(TinyNet(), loader())
    ended = time.time()
    died = float((tmp_path / "died").read_text())
    survivor = int((tmp_path / f"pid-{1 - dying}").read_text())
    assert not alive(survivor)
    # a deadline, not a speed: a survivor waiting in a collective would wait for the 30-minute timeout
    assert ended - died < 60.0, f"the survivor ended {ended - died:.1f} s after rank {dying} died"
