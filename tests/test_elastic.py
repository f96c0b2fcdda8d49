"""Elastic runs: a lost node's survivors resume under the layout that fits, keeping the global batch.

The kill tests start two torchrun agents on this machine (``--nnodes=1:2``, 2 processes each, c10d
rendezvous on localhost), kill one agent and its processes at a step, and check that the other
finishes the run on 2 processes with the weights of uninterrupted plain training."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe.checkpoint import write_meta, write_shard
from lightning_pipe.checkpoint.newest import candidates, newest_complete
from lightning_pipe.checkpoint.staging import staging_path
from lightning_pipe.checkpoint.tags import save_tag
from lightning_pipe.config import PipelineConfig
from lightning_pipe.trainer.elastic import ElasticState, layout
from tests.models import TinyNet, fit_plain, loader
from tests.pipeline import assert_same_weights, fit_pipeline

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "train_elastic.py"
pytestmark = pytest.mark.timeout(420)  # a hang guard: every wait below has its own deadline


# ---------------------------------------------------------------------------- the newest complete checkpoint
def _save(path: Path, step: int, value: float) -> None:
    path.mkdir(parents=True)
    tag = save_tag({"global_step": step, "epoch": 0}, f"token{step}")
    write_shard(path, 0, {"w": torch.full((3,), value)}, None, tag=tag)
    write_meta(path, {"global_step": step, "epoch": 0}, 1, tag)


def test_the_newest_complete_checkpoint_is_found_and_a_damaged_newer_one_passed_over(tmp_path: Path) -> None:
    assert newest_complete(tmp_path / "none") is None and newest_complete(tmp_path) is None
    _save(tmp_path / "epoch=0-step=4.ckpt", 4, 1.0)
    _save(tmp_path / "epoch=0-step=8.ckpt", 8, 2.0)
    _save(staging_path(tmp_path / "epoch=0-step=12.ckpt"), 12, 3.0)  # a save that never finished
    assert [p.name for p in candidates(tmp_path)] == ["epoch=0-step=8.ckpt", "epoch=0-step=4.ckpt"]
    found = newest_complete(tmp_path)
    assert found is not None and (found.path.name, found.step, found.refused) == ("epoch=0-step=8.ckpt", 8, ())

    shard = tmp_path / "epoch=0-step=8.ckpt" / "stage-00000.pt"
    saved = torch.load(shard, weights_only=True)
    saved["state_dict"]["w"] += 1  # one changed value: its checksum no longer matches
    torch.save(saved, shard)
    found = newest_complete(tmp_path)
    assert found is not None and (found.path.name, found.step) == ("epoch=0-step=4.ckpt", 4)
    assert len(found.refused) == 1 and "epoch=0-step=8.ckpt" in found.refused[0] and "damaged" in found.refused[0]


def test_the_layout_fits_the_world_only_when_elastic() -> None:
    assert layout(2, PipelineConfig(stages=4, elastic=True)) == layout(2, PipelineConfig(stages=None))
    assert (layout(6, PipelineConfig(stages=4, elastic=True)).stages, layout(4, PipelineConfig(stages=2)).replicas) == (
        6,
        2,
    )
    with pytest.raises(ValueError, match="does not divide the world size 2"):
        layout(2, PipelineConfig(stages=4))
    with pytest.raises(ValueError, match="elastic=0"):
        PipelineConfig(elastic=0)  # type: ignore[arg-type]


def test_a_given_rank_order_places_the_layout_unless_an_elastic_restart_changed_the_world(caplog) -> None:
    """``rank_order`` names the rank of each slot for its world; an elastic run restarted on fewer
    processes leaves it (and ``rank_speeds``) aside, with a warning, and measures the speeds instead."""
    from lightning_pipe.trainer.assemble import for_this_world

    config = PipelineConfig(stages=2, balance="time", rank_order=[0, 2, 1, 3], rank_speeds=[1.0, 0.5, 1.0, 0.5])
    assert layout(4, config).order == (0, 2, 1, 3) and for_this_world(config, 4) is config
    with pytest.raises(ValueError, match=r"rank_order=\[0, 2, 1, 3\]\): give each global rank of 2 processes once"):
        layout(2, config)  # not elastic: a world the order does not fit is a mistake
    restarted = config.replace(elastic=True)
    assert layout(2, restarted) == layout(2, PipelineConfig(stages=2, elastic=True))  # not placed
    with caplog.at_level("WARNING"):
        dropped = for_this_world(restarted, 2)
    assert dropped.rank_speeds is None and dropped.rank_order is None
    assert "rank_speeds names 4 processes and the run restarted on 2" in caplog.text
    assert "rank_order names 4 processes and the run restarted on 2" in caplog.text
    assert for_this_world(restarted, 4) is restarted
    assert for_this_world(PipelineConfig(elastic=True), 2) == PipelineConfig(elastic=True)  # nothing given


# ---------------------------------------------------------------------------- a resume with fewer replicas
def test_fewer_replicas_resume_with_more_accumulation_and_the_global_batch_kept(tmp_path: Path) -> None:
    """2 stages x 2 replicas save at the end of an epoch; 2 processes resume it elastically as 2 stages x
    1 replica accumulating 2 batches per step: the weights are those of plain training on the global
    batch of 24 throughout, and the report says what changed."""
    folder = tmp_path / "checkpoints"
    torch.manual_seed(0)
    first, plain = TinyNet(), TinyNet()
    plain.load_state_dict(first.state_dict())
    saves = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
    data = loader(n=48, batch_size=12)
    options = dict(stages=2, chunks=2, elastic=str(folder))
    fit_pipeline(first, 4, data, max_steps=2, callbacks=[saves], enable_checkpointing=True, **options)
    assert [p.name for p in candidates(folder)] == ["epoch=0-step=2.ckpt"]

    resumed = TinyNet()
    trainer = fit_pipeline(resumed, 2, data, max_steps=4, **options)
    fit_plain(plain, loader(n=48, batch_size=24), max_steps=4)
    assert_same_weights(plain, resumed)
    # the report is made in the processes; here, what the launching process chose and kept
    state = next(c for c in trainer.callbacks if isinstance(c, ElasticState))  # type: ignore[attr-defined]
    assert state.resumed == str(folder / "epoch=0-step=2.ckpt")


# ---------------------------------------------------------------------------- torchrun: a node is lost
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (an agent's workers, each in its own session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    return found


def _stamp(event: str) -> None:
    print(f"elastic-test {time.time():.3f} test: {event}", flush=True)  # with the script's, a timeline of the run


def _stop(agent: subprocess.Popen) -> None:
    """End an agent that is still running, and its processes: each runs in its own session, so they outlive an
    agent killed outright; torchrun stops them itself on SIGTERM, and what is left after 20 s is killed."""
    if agent.poll() is not None:
        return
    workers = _children(agent.pid)
    agent.terminate()
    try:
        agent.wait(timeout=20)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait(timeout=30)
    for worker in workers:
        if str(SCRIPT) in _command_line(worker):  # still this run's process, not a reused number
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker, signal.SIGKILL)


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _lose_a_node(
    out: Path, stages: int, steps: int, every: int, kill_at: int, wait_s: float = 120
) -> tuple[list[dict], str]:
    """Two agents; the second is killed with its processes once ``kill_at`` steps are done; returns the
    surviving processes' results (global rank order) and the surviving agent's output. Each wait ends within
    ``wait_s``; on any failure the agents and their processes are ended.

    Both agents start at once, the first hosting the rendezvous (``is_host``), so that both join its first
    round within ``last_call_timeout``. A lost agent is declared dead after ``keep_alive_interval x
    keep_alive_max_attempt`` seconds without a heartbeat (torchrun's default: 5 x 3), and the survivor's new
    round closes ``last_call_timeout`` after it joins: both are short here so that the restart is quick."""
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    rendezvous = "join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
    commands = [[
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=elastic-{port}",
        f"--rdzv-conf={rendezvous},is_host={host}", "--monitor-interval=0.1",
        str(SCRIPT), str(out), str(stages), str(steps), str(every), str(kill_at),
    ] for host in ("true", "false")]  # fmt: skip
    logs = [open(out / f"agent{i}.log", "w") for i in range(2)]  # noqa: SIM115  # closed below
    agents: list[subprocess.Popen] = []
    try:
        _stamp("agents started")
        for command, log in zip(commands, logs, strict=True):
            agents.append(subprocess.Popen(command, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + wait_s
        while not (out / "kill").exists():
            alive = all(agent.poll() is None for agent in agents)
            assert time.monotonic() < deadline and alive, (out / "agent0.log").read_text()[-3000:]
            time.sleep(0.05)
        lost = agents[1]
        workers = _children(lost.pid)
        lost.kill()  # a node gone: its agent and every process of it at once
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):  # one that had just ended
                os.killpg(worker, signal.SIGKILL)
        lost.wait(timeout=30)
        (out / "killed").write_text("1")
        _stamp("second agent and its processes killed")
        with contextlib.suppress(subprocess.TimeoutExpired):
            agents[0].wait(timeout=wait_s)
        assert agents[0].returncode == 0, (out / "agent0.log").read_text()[-5000:]
        _stamp("first agent done")
    finally:
        for agent in agents:
            _stop(agent)
        for log in logs:
            log.close()
    results = [torch.load(out / f"final-rank{r}-start1.pt", weights_only=False) for r in range(2)]
    return results, (out / "agent0.log").read_text()


def _merged(results: list[dict]) -> TinyNet:
    model = TinyNet()
    model.load_state_dict({k: v for r in results for k, v in r["state_dict"].items()})
    return model


def test_four_stages_lose_a_node_and_finish_on_two_as_plain_training_would(tmp_path: Path) -> None:
    results, output = _lose_a_node(tmp_path, stages=4, steps=12, every=4, kill_at=6)
    assert [r["layout"] for r in results] == [(2, 1, 0, 0), (2, 1, 1, 0)]  # 2 stages x 1 replica
    report = results[0]["report"]
    assert (report["restart"], report["resumed_step"], report["steps_redone"]) == (1, 4, 2)
    assert (report["old_layout"], report["new_layout"], report["global_batch_kept"]) == ([4, 1, 1], [2, 1, 1], True)
    assert [n[2] for n in report["lost_nodes"]] == [[2, 3]] and report["seconds_lost"] > 0
    assert "lightning-pipe elastic: restart 1: lost" in output and "resumed from step 4" in output
    # the survivors' failure messages name the lost ranks alone (rank 0 named ranks 1, 2 and 3 before the
    # heartbeat, and rank 1, finding the store gone with rank 0's process, blamed rank 0 as gone)
    assert "lightning-pipe: rank 2 (stage 2 of 4), rank 3 (stage 3 of 4) stopped without reporting" in output
    assert "rank 1 (stage 1 of 4) stopped without" not in output and "(stage 0 of 4) is gone" not in output
    metrics = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text()
    assert "elastic/resumed_step" in metrics.splitlines()[0]
    torch.manual_seed(0)
    plain = TinyNet()
    fit_plain(plain, loader(n=48, batch_size=12), max_steps=12)
    assert_same_weights(plain, _merged(results))


def test_two_by_two_lose_a_replica_and_keep_the_global_batch(tmp_path: Path) -> None:
    results, _ = _lose_a_node(tmp_path, stages=2, steps=8, every=2, kill_at=3)
    assert [r["layout"] for r in results] == [(2, 1, 0, 0), (2, 1, 1, 0)]
    assert [r["accumulate"] for r in results] == [2, 2]  # 1 replica accumulates 2 batches per step
    report = results[0]["report"]
    assert (report["resumed_step"], report["steps_redone"], report["global_batch_kept"]) == (2, 1, True)
    assert (report["old_layout"], report["new_layout"]) == ([2, 2, 1], [2, 1, 2])
    losses = [loss for _, loss in results[1]["losses"]]  # per batch after the resume: 3 epochs of 4 batches
    assert len(losses) == 12 and sum(losses[-4:]) < sum(losses[:4])  # the same batches, an epoch apart
    torch.manual_seed(0)
    plain = TinyNet()
    fit_plain(plain, loader(n=48, batch_size=24), max_steps=8)  # the global batch of 2 replicas x 12
    assert_same_weights(plain, _merged(results))
