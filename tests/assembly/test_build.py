"""``build_pipeline`` from a plain PyTorch loop: N gloo processes on the CPU train as one process trains the
whole model (weights, the loss every rank is given, the clipped global norm, an evaluation), save in the
project's checkpoint format (consolidated to the same weights) and resume from it; the guide's example runs
under torchrun as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_pipe
from lightning_pipe.assembly.build import layout_of, refuse_trainer_arguments
from lightning_pipe.checkpoint import consolidate
from lightning_pipe.config import PipelineConfig
from tests.assembly.plain_runs import Net, plain_training, run_plain_pipeline, two_bw_training

ROOT = Path(__file__).resolve().parents[2]


def _check_against_plain(results: list[dict[str, Any]], folder: Path, replicas: int = 1) -> None:
    expected = plain_training(replicas)
    for rank, got in enumerate(results):
        for name, value in got["state"].items():
            torch.testing.assert_close(value, expected["state"][name], msg=lambda m, n=name, r=rank: f"{r} {n}: {m}")
        torch.testing.assert_close(got["loaded"], got["state"])  # resumed from the save
        assert got["extra"] == {"global_step": 3}
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5), rank  # on every rank
        assert got["norms"] == pytest.approx(expected["norms"], rel=1e-5), rank  # the norm over every stage
        assert got["evaluated"] == pytest.approx(expected["evaluated"], rel=1e-5), rank
    held = {name for got in results for name in got["state"]}
    assert held == set(expected["state"])  # every layer is held somewhere, by its own name
    consolidated = consolidate(folder / "checkpoint")
    torch.testing.assert_close(consolidated["state_dict"], expected["state"])
    assert list(consolidated["state_dict"]) == list(expected["state"])  # the unsplit module's order


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "arguments",
    [{"schedule": "1f1b", "chunks": 3}, {"schedule": "interleaved_1f1b", "chunks": 4}],
    ids=lambda a: a["schedule"],
)
def test_two_processes_train_as_one_process_does(tmp_path: Path, arguments: dict[str, Any]) -> None:
    results = run_plain_pipeline(tmp_path, 2, **arguments)
    assert [len(r["state"]) for r in results] == [8, 8]  # 8 layers' weights and biases, 4 layers a process
    _check_against_plain(results, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "arguments, replicas",
    [
        ({"schedule": "1f1b", "chunks": 4}, 1),
        ({"schedule": "interleaved_1f1b", "chunks": 8}, 1),
        ({"schedule": "zero_bubble", "chunks": 4, "balance": [1, 3, 2, 2]}, 1),
        ({"schedule": "gpipe", "chunks": 3, "recompute": "always"}, 1),
        ({"schedule": "1f1b", "chunks": 2, "stages": 2}, 2),  # 2 stages x 2 replicas, each its half of a batch
        ({"schedule": "chimera", "chunks": 4}, 1),  # the losses of two pipelines, on two ranks
    ],
    ids=["1f1b", "interleaved_1f1b", "zero_bubble", "gpipe-recompute", "1f1b-replicas", "chimera"],
)
def test_four_processes_train_as_one_process_does(tmp_path: Path, arguments: dict[str, Any], replicas: int) -> None:
    _check_against_plain(run_plain_pipeline(tmp_path, 4, **arguments), tmp_path, replicas)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_asynchronous_schedule_follows_its_rule(tmp_path: Path) -> None:
    """PipeDream-2BW from a plain loop: each step applies the previous batch's gradient, taken on the
    weights that batch's forward ran on; close, save and evaluate drain the work in flight."""
    expected = two_bw_training()
    for rank, got in enumerate(run_plain_pipeline(tmp_path, 2, schedule="pipedream_2bw", chunks=2)):
        for name, value in got["state"].items():
            torch.testing.assert_close(value, expected["state"][name], msg=lambda m, n=name, r=rank: f"{r} {n}: {m}")
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5), rank
        assert got["evaluated"] == pytest.approx(expected["evaluated"], rel=1e-5), rank


def test_the_arguments_are_checked_before_the_process_group_is_asked_for() -> None:
    with pytest.raises(TypeError, match="chunkz"):
        lightning_pipe.build_pipeline(Net(), chunkz=4)
    with pytest.raises(ValueError, match="elastic restarts resume the Trainer's own checkpoints"):
        refuse_trainer_arguments(PipelineConfig(elastic=True))
    with pytest.raises(RuntimeError, match=r"launch with `torchrun --nproc-per-node=N train.py`"):
        lightning_pipe.build_pipeline(Net(), schedule="1f1b")


def test_the_layout_takes_stages_and_a_rank_order() -> None:
    assert (layout_of(4, PipelineConfig()).stages, layout_of(4, PipelineConfig(stages=2)).replicas) == (4, 2)
    assert layout_of(2, PipelineConfig(rank_order=[1, 0])).order == (1, 0)
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        layout_of(4, PipelineConfig(stages=3))


def _guide_script() -> str:
    from tests.test_docs import block_tested_by

    return block_tested_by("plain-pytorch.md", "tests/assembly/test_build.py")


@pytest.mark.timeout(240)
def test_the_guides_example_runs_under_torchrun(tmp_path: Path) -> None:
    """docs/plain-pytorch.md's script, as a user runs it: ``torchrun --nproc-per-node=2 train.py``."""
    (tmp_path / "train.py").write_text(_guide_script())
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train.py"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=220)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    losses = [float(v) for v in re.findall(r"step \d+: loss (\d+\.\d+)", output)]
    assert len(losses) == 2 * 5 and losses[-1] < losses[0], output[-3000:]  # both ranks print the same loss
    saved = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert saved == ["meta.pt", "stage-00000.pt", "stage-00001.pt"]
