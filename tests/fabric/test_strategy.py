"""``FabricPipelineStrategy`` under Lightning Fabric: its arguments, Fabric's registry and refusals; 2 gloo
processes started by Fabric's launcher train an MLP as one Fabric process trains the whole model (every
parameter, the loss every rank is given, the clipped global norm, an evaluation, and the ``fabric.save``
checkpoint consolidated to the same weights), under 32-true, bf16-mixed, 16-mixed (a gradient scaler),
bf16-true and 64-true, built on the meta device too; unchanged tiny Hugging Face models on 4 processes
(forked, they cost about a second); the guide's loop run as a script (Fabric's script launcher);
(``--runslow``) Fabric's spawn launcher."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY

import lightning_pipe
from lightning_pipe import FabricPipelineStrategy
from lightning_pipe.checkpoint import consolidate
from lightning_pipe.config import PipelineConfig
from lightning_pipe.fabric.strategy import check_scaler
from tests.fabric.fabric_runs import Run, fabric_pipeline_run, single_process

ROOT = Path(__file__).resolve().parents[2]


def _check_against_one_process(results: list[dict[str, Any]], run: Run, **tolerance: float) -> None:
    norms = 1e-2 if run.precision == "bf16-true" else 1e-5  # the norm over the stages' bf16 gradients sums in float32
    expected = single_process(run)
    for rank, got in enumerate(results):
        for name, value in got["state"].items():
            torch.testing.assert_close(
                value, expected["state"][name], **tolerance, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
            )
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5), rank  # on every rank
        assert got["norms"] == pytest.approx(expected["norms"], rel=norms), rank  # the norm over every stage
        assert got["evaluated"] == pytest.approx(expected["evaluated"], rel=1e-5), rank
    assert {name for got in results for name in got["state"]} == set(expected["state"])  # every layer, once named


def test_fabric_finds_the_strategy_by_name_with_its_launchers() -> None:
    for name, start_method in {"pipeline": "popen", "pipeline_spawn": "spawn", "pipeline_notebook": "fork"}.items():
        fabric = Fabric(strategy=name, accelerator="cpu", devices=2)
        assert isinstance(fabric.strategy, FabricPipelineStrategy)
        assert fabric.strategy.config.start_method == start_method
    assert lightning_pipe.FabricPipelineStrategy is FabricPipelineStrategy
    FabricPipelineStrategy.register_strategies(STRATEGY_REGISTRY)  # again: no error


@pytest.mark.timeout(120)
def test_importing_the_package_before_lightning_registers_the_name_with_fabric() -> None:
    """``import lightning_pipe`` first, then Fabric, in a fresh interpreter (the package's face registers the
    names as soon as Lightning is imported)."""
    code = (
        "import lightning_pipe\nfrom lightning.fabric import Fabric\n"
        "print(type(Fabric(strategy='pipeline', accelerator='cpu', devices=2).strategy).__name__)"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=110)
    assert done.stdout.strip() == "FabricPipelineStrategy", done.stderr[-2000:]


def test_the_arguments_are_checked_and_the_replicas_read_their_own_parts() -> None:
    with pytest.raises(TypeError, match="chunkz"):
        FabricPipelineStrategy(chunkz=4)
    strategy = Fabric(strategy=FabricPipelineStrategy(stages=2), accelerator="cpu", devices=4).strategy
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}  # 2 stages x 2 replicas
    assert Fabric(strategy="pipeline", accelerator="cpu", devices=2).strategy.distributed_sampler_kwargs == {
        "num_replicas": 1,
        "rank": 0,
    }  # one pipeline: both stages read the whole batches


def test_what_the_pipeline_does_otherwise_is_refused_with_the_fix() -> None:
    strategy = FabricPipelineStrategy()
    with pytest.raises(RuntimeError, match=r"Remove fabric.backward\(loss\)"):
        strategy.backward(torch.ones(()), None)
    with pytest.raises(ValueError, match="Leave norm_type at 2"):
        strategy.clip_gradients_norm(torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)]), 1.0, norm_type=1)
    with pytest.raises(RuntimeError, match=r"call model = fabric.setup\(model, optimizer\) first"):
        strategy.train_step(torch.nn.Linear(1, 1), None, lambda b: torch.zeros(()))
    scaler = torch.amp.GradScaler("cpu")  # precision="16-mixed"
    with pytest.raises(ValueError, match="applies gradients a step late"):
        check_scaler(PipelineConfig(schedule="pipedream"), scaler)
    with pytest.raises(ValueError, match="replicas_sync='allreduce'"):
        check_scaler(PipelineConfig(stages=1, replicas_sync="elastic"), scaler)
    check_scaler(PipelineConfig(schedule="1f1b"), scaler)  # synchronous schedules take it


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "precision, arguments, empty_init, tolerance",
    [
        ("32-true", {"schedule": "1f1b", "chunks": 3}, False, {}),
        ("bf16-mixed", {"schedule": "1f1b", "chunks": 1}, False, {"rtol": 0, "atol": 0}),  # the same ops: bit for bit
        ("16-mixed", {"schedule": "1f1b", "chunks": 1}, False, {"rtol": 0, "atol": 0}),  # scaled losses, one verdict
        ("bf16-true", {"schedule": "1f1b", "chunks": 1}, False, {"rtol": 0, "atol": 0}),  # bf16 weights cross too
        ("64-true", {"schedule": "1f1b", "chunks": 1}, False, {"rtol": 0, "atol": 0}),
        ("32-true", {"schedule": "interleaved_1f1b", "chunks": 4}, True, {}),  # built on the meta device
    ],
    ids=["32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true", "interleaved-meta"],
)
def test_two_processes_train_as_one_fabric_process_does(
    tmp_path: Path, precision: str, arguments: dict[str, Any], empty_init: bool, tolerance: dict[str, float]
) -> None:
    run = Run(arguments=arguments, precision=precision, save_after=3, empty_init=empty_init)
    results = fabric_pipeline_run(tmp_path, 2, run)
    assert [len(r["state"]) for r in results] == [8, 8]  # 8 layers' weights and biases, 4 layers a process
    assert [r["on_meta"] for r in results] == [empty_init] * 2
    assert all(r["second_refused"] for r in results)
    _check_against_one_process(results, run, **tolerance)
    consolidated = consolidate(tmp_path / "checkpoint")  # fabric.save's stage files, as the Trainer's
    saved = {k: v.float() for k, v in consolidated["state_dict"].items()}
    torch.testing.assert_close(saved, {k: v for r in results for k, v in r["state"].items()})
    assert consolidated["step"] == 3 and consolidated["fabric"] == {"module": "model", "optimizers": ["optimizer"]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fabrics_spawn_launcher_trains_as_one_process_does(tmp_path: Path) -> None:
    """``strategy="pipeline_spawn"``'s launcher: the processes start afresh, the set-up Fabric pickled to them."""
    run = Run(arguments={"schedule": "1f1b", "chunks": 3})
    _check_against_one_process(fabric_pipeline_run(tmp_path, 2, run, start_method="spawn"), run)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, path", [("gpt2", "transformer.h"), ("llama", "model.layers")])
def test_an_unchanged_hugging_face_model_on_four_processes(tmp_path: Path, model: str, path: str) -> None:
    pytest.importorskip("transformers")
    run = Run(model=model, samples=8, arguments={"schedule": "1f1b", "chunks": 4, "module": path})
    _check_against_one_process(fabric_pipeline_run(tmp_path, 4, run), run, rtol=1e-4, atol=1e-6)


def _guide_script() -> str:
    from tests.test_docs import block_tested_by

    return block_tested_by("fabric.md", "tests/fabric/test_strategy.py")


@pytest.mark.timeout(300)
def test_the_guides_loop_runs_as_a_script(tmp_path: Path) -> None:
    """docs/fabric.md's script, as a user runs it: ``python train.py`` (Fabric's launcher starts the second process)."""
    (tmp_path / "train.py").write_text(_guide_script())
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    losses = [float(v) for v in re.findall(r"step \d+: loss (\d+\.\d+)", output)]
    assert len(losses) >= 4 and losses[-1] < losses[0], output[-3000:]
    saved = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert saved == ["meta.pt", "stage-00000.pt", "stage-00001.pt"]
