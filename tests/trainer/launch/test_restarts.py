"""Elastic runs: a lost node's survivors resume under the layout that fits, keeping the global batch.

The kill tests start two torchrun agents on this machine (``--nnodes=1:2``, 2 processes each, c10d
rendezvous on localhost), kill one agent and its processes at a step, and check that the other
finishes the run on 2 processes with the weights of uninterrupted plain training."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import PipelineStrategy
from lightning_pipe.checkpoint import consolidate, write_meta, write_shard
from lightning_pipe.checkpoint.newest import candidates, newest_complete
from lightning_pipe.checkpoint.staging import staging_path
from lightning_pipe.checkpoint.tags import save_tag
from lightning_pipe.config import PipelineConfig
from lightning_pipe.trainer.launch.restarts import ElasticState, layout, resume_arguments
from tests.models import TinyNet, dataset, fit_plain, loader
from tests.pipeline import assert_same_weights, fit_pipeline

ROOT = Path(__file__).resolve().parents[3]
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
    assert newest_complete(tmp_path, after=(8, 0)) is None  # only later saves than a given one are read

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
    from lightning_pipe.trainer.stage_setup import for_this_world

    config = PipelineConfig(stages=2, balance="time", rank_order=[0, 2, 1, 3], rank_speeds=[1.0, 0.5, 1.0, 0.5])
    assert layout(4, config).order == (0, 2, 1, 3) and for_this_world(config, 4) is config
    with pytest.raises(ValueError, match=r"rank_order=\[0, 2, 1, 3\]\): names 4 ranks for 2 processes; give each"):
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


def _fitting(devices: int = 1, num_nodes: int = 1, **strategy: object) -> L.Trainer:
    """A Trainer about to fit (nothing launched): what the launchers hand to :func:`resume_arguments`."""
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=PipelineStrategy(**strategy), logger=False
    )
    trainer.state.fn = TrainerFn.FITTING
    return trainer


def _chosen(trainer: L.Trainer, folder: Path, given: Path | str | None) -> str | None:
    """The ``ckpt_path`` that ``fit(model, ckpt_path=given)`` runs with in an elastic run watching ``folder``."""
    path = str(given) if given is not None else None
    args, kwargs = resume_arguments(trainer, trainer.fit, (TinyNet(),), {"ckpt_path": path}, str(folder))
    return inspect.signature(trainer.fit).bind(*args, **kwargs).arguments.get("ckpt_path")


def test_the_watched_folder_beats_the_given_checkpoint_once_it_holds_a_newer_one(tmp_path: Path) -> None:
    """``fit(ckpt_path=START)`` in an elastic run: START until the watched folder holds a later save (by step,
    as the folder's checkpoints are ordered), then the folder's newest; a given path whose step cannot be
    read (Lightning's ``"last"``) is left as given."""
    folder, given = tmp_path / "checkpoints", tmp_path / "start" / "epoch=0-step=4.ckpt"
    _save(given, 4, 1.0)
    trainer = _fitting(elastic=str(folder))
    assert _chosen(trainer, folder, given) == str(given)  # nothing saved yet
    assert _chosen(trainer, folder, None) is None
    _save(folder / "epoch=0-step=4.ckpt", 4, 2.0)
    assert _chosen(trainer, folder, given) == str(given)  # the same step: the given one
    _save(folder / "epoch=1-step=8.ckpt", 8, 3.0)
    assert _chosen(trainer, folder, given) == str(folder / "epoch=1-step=8.ckpt")
    plain = tmp_path / "plain.ckpt"  # a plain Lightning checkpoint of a later step than the folder's
    torch.save({"global_step": 12, "epoch": 2, "state_dict": {}}, plain)
    assert _chosen(trainer, folder, plain) == str(plain)
    assert _chosen(trainer, folder, "last") == "last"


def test_an_elastic_chimera_run_that_a_lost_node_would_leave_odd_is_refused_at_the_first_start(tmp_path: Path) -> None:
    """Chimera runs on an even world only; with 3 processes per node, losing one of 2 nodes leaves 3: refused
    before anything starts, naming what survives. 2 processes per node pass."""
    trainer = _fitting(devices=3, num_nodes=2, schedule="chimera", elastic=str(tmp_path))
    with pytest.raises(MisconfigurationException, match=r"3 processes per node.*even number of processes per node"):
        resume_arguments(trainer, trainer.fit, (TinyNet(),), {}, str(tmp_path))
    trainer = _fitting(devices=2, num_nodes=2, schedule="chimera", elastic=str(tmp_path))
    resume_arguments(trainer, trainer.fit, (TinyNet(),), {}, str(tmp_path))


def test_an_error_in_an_elastic_restart_says_it_comes_from_the_restart(tmp_path: Path, monkeypatch) -> None:
    """What fails in a start that torchrun's agent restarted carries a note naming the restart (the first start's
    errors do not)."""
    state = ElasticState(tmp_path, None)
    trainer = _fitting(elastic=str(tmp_path))
    first, again = ValueError("first"), ValueError("again")
    state.on_exception(trainer, TinyNet(), first)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    state.on_exception(trainer, TinyNet(), again)
    assert not getattr(first, "__notes__", [])
    assert len(again.__notes__) == 1 and "lightning-pipe elastic: raised in restart 2 of the run" in again.__notes__[0]


# ---------------------------------------------------------------------------- a resume with fewer replicas
def test_fewer_replicas_resume_with_more_accumulation_and_the_global_batch_kept(tmp_path: Path) -> None:
    """2 stages x 2 replicas, shuffled, save in the middle of an epoch; 2 processes resume it elastically as 2
    stages x 1 replica accumulating 2 batches per step: the weights are those of uninterrupted plain training on
    the global batch of 24 in the same order (the epoch's permutation of the run's seed), the rest of the saved
    epoch and the next one included, and the report says what changed."""
    folder = tmp_path / "checkpoints"
    L.seed_everything(0)
    first, plain = TinyNet(), TinyNet()
    plain.load_state_dict(first.state_dict())
    saves = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
    data = DataLoader(dataset(72), batch_size=12, shuffle=True)  # 3 steps of 2 x 12 per epoch
    options = dict(stages=2, chunks=2, elastic=str(folder))
    fit_pipeline(first, 4, data, max_steps=2, callbacks=[saves], enable_checkpointing=True, **options)
    assert [p.name for p in candidates(folder)] == ["epoch=0-step=2.ckpt"]

    resumed = TinyNet()
    trainer = fit_pipeline(resumed, 2, data, max_steps=5, **options)
    order = DistributedSampler(dataset(72), num_replicas=1, rank=0, shuffle=True, seed=0)
    fit_plain(plain, DataLoader(dataset(72), batch_size=24, sampler=order), max_steps=5)
    assert_same_weights(plain, resumed)
    # the report is made in the processes; here, what the launching process chose and kept
    state = next(c for c in trainer.callbacks if isinstance(c, ElasticState))  # type: ignore[attr-defined]
    assert state.resumed == str(folder / "epoch=0-step=2.ckpt")


class _Reports(Callback):
    """Each rank's elastic report, written where the test reads it (the processes are forked)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = next(c for c in trainer.callbacks if isinstance(c, ElasticState))  # type: ignore[attr-defined]
        torch.save(state.report, self.folder / f"report{trainer.global_rank}.pt")


def _saved_by_two_replicas(folder: Path, **options: object) -> Path:
    """2 stages x 2 replicas (4 processes) save at the end of epoch 0 (step 2): the checkpoint."""
    torch.manual_seed(0)
    saves = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
    data = loader(n=48, batch_size=12)
    fit_pipeline(TinyNet(), 4, data, max_steps=2, callbacks=[saves], enable_checkpointing=True, **options)
    (saved,) = candidates(folder)
    return saved


def test_an_asynchronous_schedule_with_replicas_goes_on_with_one_replica_and_says_the_batch_changed(
    tmp_path: Path,
) -> None:
    """pipedream refuses gradient accumulation, so 2 replicas become 1 keeping each replica's batch: the run
    goes on (it was refused at every restart) with the weights of a plain resume of the checkpoint on 2
    processes, and the report says that the global batch was not kept and why."""
    folder = tmp_path / "checkpoints"
    options = dict(stages=2, chunks=2, schedule="pipedream")
    saved = _saved_by_two_replicas(folder, elastic=str(folder), **options)
    resumed, straight = TinyNet(), TinyNet()
    data = loader(n=48, batch_size=12)
    fit_pipeline(resumed, 2, data, max_steps=4, callbacks=[_Reports(tmp_path)], elastic=str(folder), **options)
    fit_pipeline(straight, 2, data, max_steps=4, ckpt_path=str(saved), **options)
    assert_same_weights(straight, resumed, rtol=0, atol=0)
    report = torch.load(tmp_path / "report0.pt", weights_only=False)
    assert (report["old_layout"], report["new_layout"], report["global_batch_kept"]) == ([2, 2, 1], [2, 1, 1], False)
    assert any("schedule='pipedream' applies one batch per optimizer step" in note for note in report["notes"])


def test_elastic_averaging_left_with_one_replica_goes_on_as_one_pipeline(tmp_path: Path, monkeypatch) -> None:
    """``replicas_sync="elastic"`` restarted with 1 replica of each stage (it was refused at every restart):
    nothing is left to average, so the run goes on as one pipeline from replica 0's weights (the checkpoint's),
    accumulating 2 batches to keep the global batch: the weights of plain Lightning resumed from the
    consolidated checkpoint on batches of 24."""
    folder = tmp_path / "checkpoints"
    options = dict(stages=2, chunks=2, replicas_sync="elastic", replicas_sync_period=1, elastic=str(folder))
    saved = _saved_by_two_replicas(folder, **options)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # this start is a restart by torchrun's agent
    resumed, plain = TinyNet(), TinyNet()
    fit_pipeline(resumed, 2, loader(n=48, batch_size=12), max_steps=4, callbacks=[_Reports(tmp_path)], **options)
    consolidate(saved, tmp_path / "plain.ckpt")
    fit_plain(plain, loader(n=48, batch_size=24), max_steps=4, ckpt_path=str(tmp_path / "plain.ckpt"))
    assert_same_weights(plain, resumed)
    report = torch.load(tmp_path / "report0.pt", weights_only=False)
    assert (report["new_layout"], report["global_batch_kept"]) == ([2, 1, 2], True)
    assert any("replicas_sync='elastic' is off" in note for note in report["notes"])


def test_a_restart_from_a_given_checkpoint_before_the_first_save_keeps_the_global_batch(
    tmp_path: Path, monkeypatch
) -> None:
    """``fit(ckpt_path=START)``, START saved without ``elastic`` (no layout with it): 2 x 2 lose a node before
    the watched folder's first save, and the restart resumes START on 1 replica. The layout of the start
    before comes from the progress file, so it accumulates 2 batches: plain Lightning resumed from START on
    batches of 24."""
    start = ModelCheckpoint(dirpath=tmp_path / "start", every_n_train_steps=4, save_top_k=-1)
    data, options = loader(n=48, batch_size=12), dict(stages=2, chunks=2, elastic=str(tmp_path / "checkpoints"))
    torch.manual_seed(0)
    fit_pipeline(TinyNet(), 2, data, max_steps=4, callbacks=[start], enable_checkpointing=True, stages=2, chunks=2)
    (given,) = candidates(tmp_path / "start")
    fit_pipeline(TinyNet(), 4, data, ckpt_path=str(given), max_steps=5, **options)  # one step as 2 x 2, no save
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # this start is a restart by torchrun's agent
    resumed, plain = TinyNet(), TinyNet()
    fit_pipeline(resumed, 2, data, ckpt_path=str(given), max_steps=7, callbacks=[_Reports(tmp_path)], **options)
    consolidate(given, tmp_path / "plain.ckpt")
    fit_plain(plain, loader(n=48, batch_size=24), max_steps=7, ckpt_path=str(tmp_path / "plain.ckpt"))
    assert_same_weights(plain, resumed)
    report = torch.load(tmp_path / "report0.pt", weights_only=False)
    assert (report["checkpoint"], report["resumed_step"], report["steps_redone"]) == (str(given), 4, 1)
    assert (report["old_layout"], report["new_layout"], report["global_batch_kept"]) == ([2, 2, 1], [2, 1, 2], True)


def test_elastic_averaging_resumed_from_a_checkpoint_without_its_state_centers_on_the_checkpoint(
    tmp_path: Path,
) -> None:
    """A run that grows back to 2 replicas after a restart trained on 1 (under ``"allreduce"``): its checkpoint
    holds no center, so the center starts at the checkpoint's weights (it stayed at the module's own initial
    weights, and the first pull would have drawn the replicas towards them)."""
    from tests.runtime.replicas.test_replicas_sync import _RecordReplicas

    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    options = dict(stages=2, chunks=2)
    torch.manual_seed(0)
    fit_pipeline(TinyNet(), 2, loader(n=48), max_steps=2, callbacks=[saves], enable_checkpointing=True, **options)
    (saved,) = candidates(tmp_path / "ckpt")
    torch.manual_seed(1)  # other initial weights
    records = _RecordReplicas(str(tmp_path))
    fit_pipeline(TinyNet(), 4, loader(n=48), max_steps=3, ckpt_path=str(saved), callbacks=[records],
                 replicas_sync="elastic", replicas_sync_period=100, **options)  # fmt: skip
    weights = consolidate(saved)["state_dict"]
    for rank in range(4):
        center = torch.load(tmp_path / f"replica{rank}.pt", weights_only=True)["center"]
        assert center and all(torch.equal(value, weights[name].float()) for name, value in center.items()), rank


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
    out: Path,
    stages: int,
    steps: int,
    every: int,
    kill_at: int,
    where: str = "step",
    start: str = "",
    wait_s: float = 120,
) -> tuple[list[dict], str]:
    """Two agents; the second is killed with its processes once ``kill_at`` steps are done (``where="save"``:
    inside the save of step ``kill_at``); every start fits from ``ckpt_path=start`` where given. Returns the
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
        str(SCRIPT), str(out), str(stages), str(steps), str(every), str(kill_at), where, start,
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


def test_four_stages_lose_a_node_inside_a_save_and_finish_on_two_from_the_newest_checkpoint(tmp_path: Path) -> None:
    """A script that fits from ``ckpt_path=START`` (step 4, saved by 2 stages) on every start: the first start
    (4 stages) saves at step 8 and loses a node inside the save of step 12; the restart resumes from the
    watched folder's step 8, newer than START, and does steps 9 to 12 again (4: the kill came after step 12).
    The weights are those of 16 steps of uninterrupted plain training."""
    torch.manual_seed(0)
    start = ModelCheckpoint(dirpath=tmp_path / "start", every_n_train_steps=4, save_top_k=-1)
    fit_pipeline(TinyNet(), 2, loader(n=48, batch_size=12), max_steps=4, callbacks=[start], enable_checkpointing=True)
    (given,) = candidates(tmp_path / "start")
    results, output = _lose_a_node(tmp_path, stages=4, steps=16, every=4, kill_at=12, where="save", start=str(given))
    assert [r["layout"] for r in results] == [(2, 1, 0, 0), (2, 1, 1, 0)]  # 2 stages x 1 replica
    report = results[0]["report"]
    assert (report["restart"], report["resumed_step"], report["steps_redone"]) == (1, 8, 4)
    assert report["checkpoint"] == str(tmp_path / "checkpoints" / "epoch=1-step=8.ckpt")
    assert (report["old_layout"], report["new_layout"], report["global_batch_kept"]) == ([4, 1, 1], [2, 1, 1], True)
    assert [n[2] for n in report["lost_nodes"]] == [[2, 3]] and report["seconds_lost"] > 0
    assert "lightning-pipe elastic: restart 1: lost" in output and "resumed from step 8" in output
    assert "newer than the given ckpt_path" in output
    # the survivors' failure messages name the lost ranks alone (rank 0 named ranks 1, 2 and 3 before the
    # heartbeat, and rank 1, finding the store gone with rank 0's process, blamed rank 0 as gone)
    assert "lightning-pipe: rank 2 (stage 2 of 4), rank 3 (stage 3 of 4) stopped without reporting" in output
    assert "rank 1 (stage 1 of 4) stopped without" not in output and "(stage 0 of 4) is gone" not in output
    metrics = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text()
    assert "elastic/resumed_step" in metrics.splitlines()[0]
    torch.manual_seed(0)
    plain = TinyNet()
    fit_plain(plain, loader(n=48, batch_size=12), max_steps=16)
    assert_same_weights(plain, _merged(results))


def test_two_by_two_lose_a_replica_before_the_first_checkpoint_and_keep_the_global_batch(tmp_path: Path) -> None:
    """2 stages x 2 replicas lose a node at step 3, before the first save (step 4): the restart starts again
    from step 0 as 2 stages x 1 replica accumulating 2 batches (the first layout, from the progress file), says
    so, and ends with the weights of plain training on the global batch of 24."""
    results, output = _lose_a_node(tmp_path, stages=2, steps=8, every=4, kill_at=3)
    assert [r["layout"] for r in results] == [(2, 1, 0, 0), (2, 1, 1, 0)]
    assert [r["accumulate"] for r in results] == [2, 2]  # 1 replica accumulates 2 batches per step
    report = results[0]["report"]
    assert (report["checkpoint"], report["resumed_step"], report["steps_redone"]) == (None, 0, 3)
    assert (report["old_layout"], report["new_layout"], report["global_batch_kept"]) == ([2, 2, 1], [2, 1, 2], True)
    assert [n[2] for n in report["lost_nodes"]] == [[2, 3]]
    assert "lightning-pipe elastic: restart 1: lost" in output and "no checkpoint yet" in output
    losses = [loss for _, loss in results[1]["losses"]]  # per batch after the restart: 4 epochs of 4 batches
    assert len(losses) == 16 and sum(losses[-4:]) < sum(losses[:4])  # the same batches, epochs apart
    torch.manual_seed(0)
    plain = TinyNet()
    fit_plain(plain, loader(n=48, batch_size=24), max_steps=8)  # the global batch of 2 replicas x 12
    assert_same_weights(plain, _merged(results))


# ---------------------------------------------------------------------------- the docs' script
def test_the_docs_script_runs_as_written(tmp_path: Path) -> None:
    """docs/elastic.md's script under torchrun on 2 CPU processes, with only its folder and step counts
    changed: it trains, saves, and its ModelCheckpoint keeps the 2 newest saves (Lightning refused the
    ModelCheckpoint the page had before). One start: the restarts are the tests above."""
    text = (ROOT / "docs" / "elastic.md").read_text()
    match = re.search(r"```python\n(.*?)```", text[text.index("## The script") :], re.S)
    assert match is not None, "no python block under '## The script'"
    script, changes = (
        match.group(1),
        {
            'CHECKPOINTS = "/shared/run1/checkpoints"': f"CHECKPOINTS = {str(tmp_path / 'checkpoints')!r}",
            "STEPS, SAVE_EVERY = 2000, 200": "STEPS, SAVE_EVERY = 6, 2",
        },
    )
    for line, replacement in changes.items():
        assert line in script, line
        script = script.replace(line, replacement)
    (tmp_path / "train.py").write_text(script)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train.py"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "`max_steps=6` reached" in output and "2 stages (2 processes)" in output  # stages=4 fits 2 processes as 2
    assert sorted(p.name for p in candidates(tmp_path / "checkpoints")) == [
        "epoch=0-step=4.ckpt",
        "epoch=0-step=6.ckpt",
    ]
