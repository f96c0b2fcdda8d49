"""The Hydra command line: every config option composes, each recipe runs, sweeps, the README's commands."""

from __future__ import annotations

import csv
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

from lightning_pipe.cli import CONFIG_DIR, build_strategy, run
from lightning_pipe.launcher import child_overrides
from lightning_pipe.strategy import PipelineStrategy

pytestmark = pytest.mark.timeout(300)
GROUPS = {group: sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml")) for group in ("recipe", "strategy", "trainer")}
# small enough for a 2-core machine: a narrow VGG on little synthetic data, a tiny BERT on little text
SMALL = {
    "vgg19_cifar100": ["recipe.model.width=0.125", "recipe.data.synthetic_train=96", "recipe.data.synthetic_val=32",
                       "recipe.data.batch_size=8"],
    "bert_mlm": ["recipe.data.limit_chars=40000", "recipe.data.max_len=32", "recipe.data.vocab_size=500",
                 "recipe.data.batch_size=8"],
}  # fmt: skip
QUICK = ["trainer.max_steps=3", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1"]


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def test_config_groups_are_complete() -> None:
    assert GROUPS["recipe"] == ["bert_mlm", "vgg19_cifar100"]
    assert GROUPS["strategy"] == ["1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "none", "pipedream", "pipedream_2bw", "zbv", "zero_bubble"]
    assert GROUPS["trainer"] == ["cpu", "gpu"]


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_option_composes_and_instantiates(group: str) -> None:
    for option in GROUPS[group]:
        cfg = _compose([f"{group}={option}"])
        resolved = OmegaConf.to_container(cfg.recipe, resolve=False)  # interpolations resolve below
        assert resolved
        if "root" in cfg.recipe.data:
            with open_dict(cfg):
                cfg.recipe.data.root = "/tmp/unused"  # ${hydra:runtime.cwd} needs a running app
        model = instantiate(cfg.recipe.model)
        data = instantiate(cfg.recipe.data)
        assert hasattr(model, "layers") and hasattr(data, "train_dataloader")
        strategy, devices = build_strategy(cfg.strategy, cfg.trainer.devices)
        if cfg.strategy.name == "none":
            assert strategy == "auto" and devices == 1
        else:
            assert isinstance(strategy, PipelineStrategy) and strategy.schedule_name == cfg.strategy.schedule
        assert cfg.trainer.accelerator in ("cpu", "gpu")


def test_overrides_reach_the_strategy() -> None:
    cfg = _compose(["strategy=gpipe", "strategy.chunks=8", "strategy.balance=[3,1]", "strategy.checkpoint=always"])
    strategy, _ = build_strategy(cfg.strategy, 2)
    assert (strategy.schedule_name, strategy.chunks, strategy.balance, strategy.checkpoint_mode) == ("gpipe", 8, [3, 1], "always")
    assert strategy.gradient_accumulation_fusion is True
    cfg = _compose(["strategy=pipedream_2bw", "strategy.gradient_accumulation_fusion=false"])
    assert build_strategy(cfg.strategy, 2)[0].gradient_accumulation_fusion is False
    cfg = _compose(["strategy=1f1b", "strategy.stages=2", "strategy.data_parallel=shard", "trainer.devices=4", "strategy.check_data=5"])
    strategy, devices = build_strategy(cfg.strategy, cfg.trainer.devices)
    assert (strategy.stages, strategy.data_parallel, devices, strategy.check_data) == (2, "shard", 4, 5)
    assert build_strategy(_compose(["strategy=gpipe"]).strategy, 2)[0].stages is None  # one stage per process


def test_a_bad_data_parallel_mode_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="'zero'.*replicate, shard"):
        build_strategy(_compose(["strategy.data_parallel=zero"]).strategy, 2)


def test_virtual_stages_reach_the_strategy() -> None:
    cfg = _compose(["strategy=interleaved_1f1b", "strategy.virtual_stages=3"])
    assert build_strategy(cfg.strategy, 2)[0].virtual_stages == 3
    assert build_strategy(_compose(["strategy=zbv"]).strategy, 2)[0].virtual_stages == 2
    izb = build_strategy(_compose(["strategy=interleaved_zero_bubble", "strategy.virtual_stages=4"]).strategy, 2)[0]
    assert (izb.schedule_name, izb.virtual_stages) == ("interleaved_zero_bubble", 4)
    assert build_strategy(_compose(["strategy=zero_bubble"]).strategy, 2)[0].virtual_stages == 1
    with pytest.raises(ValueError, match="one stage per process"):
        build_strategy(_compose(["strategy=gpipe", "strategy.virtual_stages=2"]).strategy, 2)


def test_a_bad_value_names_it() -> None:
    cfg = _compose(["strategy.schedule=zigzag"])
    with pytest.raises(ValueError, match="'zigzag'"):
        build_strategy(cfg.strategy, 2)


@pytest.mark.parametrize("recipe", ["vgg19_cifar100", "bert_mlm"])
@pytest.mark.parametrize("strategy", ["gpipe", "1f1b", "none", "zbv"])
def test_each_recipe_runs(tmp_path: Path, recipe: str, strategy: str) -> None:
    cfg = _compose([f"recipe={recipe}", f"strategy={strategy}", *SMALL[recipe], *QUICK]
                   + ([] if strategy == "none" else ["strategy.start_method=fork", "strategy.chunks=2"]))  # fmt: skip
    with open_dict(cfg):
        if "root" in cfg.recipe.data:
            cfg.recipe.data.root = str(tmp_path / "data")
        del cfg.hydra
    metrics = run(cfg, output_dir=str(tmp_path))
    assert metrics["train_loss"] > 0 and "val_loss" in metrics and metrics["samples_per_sec"] > 0
    assert (tmp_path / "logs" / "version_0" / "metrics.csv").is_file()


def _command(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", "lightning_pipe", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=280)


def test_sweep_makes_one_folder_with_a_folder_per_job(tmp_path: Path) -> None:
    """Each job's extra process runs that job only: one sweep folder, one folder per job, and nothing
    else (before, the extra process re-ran the whole sweep into a second folder)."""
    quick = ["trainer.val_check_interval=6", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1"]
    result = _command(["-m", "strategy=gpipe,1f1b", "trainer.max_steps=12", *SMALL["bert_mlm"], *quick], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (result.stdout + result.stderr).count("Launching 2 jobs locally") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multirun"]
    (day,) = (tmp_path / "multirun").iterdir()
    (sweep,) = day.iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    for job, schedule in (("0", "gpipe"), ("1", "1f1b")):
        with open(sweep / job / "logs" / "version_0" / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        assert max(int(row["step"]) for row in rows) == 11 and any(row["train_loss"] for row in rows)
        assert f"schedule: {schedule}" in (sweep / job / ".hydra" / "config.yaml").read_text()


def test_child_overrides_drop_the_sweep() -> None:
    task = ["strategy=gpipe", "trainer.max_steps=12"]
    hydra = ["hydra.mode=MULTIRUN", "hydra.sweep.dir=sweep", "hydra.job.chdir=false", "hydra/launcher=basic"]
    assert child_overrides(task, hydra) == [*task, "hydra.job.chdir=false"]


def test_help_names_the_tool_and_its_groups(tmp_path: Path) -> None:
    result = _command(["--help"], tmp_path)
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0].startswith("lightning-pipe: pipeline model parallelism")
    assert "recipe: bert_mlm, vgg19_cifar100" in lines and "trainer: cpu, gpu" in lines
    assert "strategy: 1f1b, gpipe, interleaved_1f1b, interleaved_zero_bubble, none, pipedream, pipedream_2bw, zbv, zero_bubble" in lines
    assert "powered by Hydra" not in result.stdout


def test_pipedream_with_tied_embeddings_names_the_override(tmp_path: Path) -> None:
    """One short message before any process starts (the strategy would fail in every process)."""
    result = _command(["strategy=pipedream"], tmp_path)
    assert result.returncode != 0
    message = result.stderr.strip()
    assert "recipe.model.tie_embeddings=false" in message and "pipedream_2bw" in message
    assert len(message.splitlines()) == 1 and "Traceback" not in result.stdout + result.stderr


def test_strategy_none_says_what_runs(caplog: pytest.LogCaptureFixture) -> None:
    cfg = _compose(["strategy=none", "trainer.devices=2"])
    with caplog.at_level(logging.WARNING, logger="lightning_pipe.cli"):
        assert build_strategy(cfg.strategy, cfg.trainer.devices) == ("auto", 1)
    assert "one process on one device; trainer.devices=2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_pipe.cli"):
        build_strategy(cfg.strategy, 1)
    assert caplog.text == ""


def test_consolidate_command_runs_without_warnings(tmp_path: Path) -> None:
    """``python -m lightning_pipe.checkpoint`` (its module is imported by the package already)."""
    result = subprocess.run([sys.executable, "-W", "error", "-m", "lightning_pipe.checkpoint", "--help"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0 and "usage: python -m lightning_pipe.checkpoint" in result.stdout, result.stderr
    assert result.stderr == ""


def test_readme_commands(tmp_path: Path) -> None:
    """The README's first-run command (shortened) from an unrelated folder, --cfg job, and a bad override."""
    result = _command([*SMALL["bert_mlm"], *QUICK, "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max_steps=3" in result.stderr + result.stdout
    assert (tmp_path / "run" / "logs" / "version_0" / "metrics.csv").is_file()
    shown = _command(["--cfg", "job", "recipe=vgg19_cifar100"], tmp_path)
    assert shown.returncode == 0 and "vgg19_cifar100" in shown.stdout
    bad = _command(["strategy.chunkz=3"], tmp_path)
    assert bad.returncode != 0 and "chunkz" in bad.stderr
    missing = _command(["strategy=zigzag"], tmp_path)
    assert missing.returncode != 0 and "zigzag" in missing.stderr and "1f1b" in missing.stderr


def test_weights_and_deferred_builds_compose(tmp_path: Path) -> None:
    weights = tmp_path / "start.safetensors"
    weights.write_bytes(b"")
    cfg = _compose(["recipe=bert_mlm", f"strategy.weights={weights}", "recipe.model.build=configure_model"])
    strategy, _ = build_strategy(cfg.strategy, 2)
    assert strategy.weights == str(weights)
    assert instantiate(cfg.recipe.model).layers is None  # created in configure_model()
    assert instantiate(_compose(["recipe=bert_mlm", "recipe.model.size=large"]).recipe.model).layers is None
    cfg = _compose(["recipe=vgg19_cifar100", "recipe.model.width=3"])
    with open_dict(cfg):
        cfg.recipe.data.root = "/tmp/unused"
    assert instantiate(cfg.recipe.model).layers is None
    with pytest.raises(Exception, match="recipe.model.build='later': valid values are auto, eager, configure_model"):
        instantiate(_compose(["recipe=bert_mlm", "recipe.model.build=later"]).recipe.model)
