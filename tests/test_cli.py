"""The Hydra command line: every config option composes, each recipe runs, sweeps, the README's commands."""

from __future__ import annotations

import csv
import functools
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_pipe.cli import CONFIG_DIR, build_strategy, run
from lightning_pipe.strategy import PipelineStrategy
from lightning_pipe.trainer.launch.launcher import child_overrides

pytestmark = pytest.mark.timeout(300)
GROUPS = {
    group: sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))
    for group in ("recipe", "strategy", "trainer")
}
# small enough for a 2-core machine: a narrow VGG on little synthetic data, a tiny BERT on little text
SMALL = {
    "vgg19_cifar100": ["recipe.model.width=0.125", "recipe.data.synthetic_train=96", "recipe.data.synthetic_val=32",
                       "recipe.data.batch_size=8"],
    "bert_mlm": ["recipe.data.limit_chars=40000", "recipe.data.max_len=32", "recipe.data.vocab_size=500",
                 "recipe.data.batch_size=8"],
    "llama": ["recipe.data.limit_chars=40000", "recipe.data.max_len=32", "recipe.data.vocab_size=500",
              "recipe.data.batch_size=8"],
}  # fmt: skip
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None  # recipe=llama needs it (the hf extra)
QUICK = [
    "trainer.max_steps=3",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
]


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def _check_keys(cfg: DictConfig) -> None:
    from lightning_pipe.cli import check_keys

    check_keys(cfg)


def test_config_groups_are_complete() -> None:
    assert GROUPS["recipe"] == ["bert_mlm", "llama", "vgg19_cifar100"]
    assert GROUPS["strategy"] == [
        "1f1b",
        "chimera",
        "dualpipev",
        "gpipe",
        "interleaved_1f1b",
        "interleaved_zero_bubble",
        "none",
        "pipedream",
        "pipedream_2bw",
        "pipeline",
        "pipemare",
        "wpipe",
        "xpipe",
        "zbv",
        "zero_bubble",
    ]
    assert GROUPS["trainer"] == ["cpu", "gpu"]


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_option_composes_and_instantiates(group: str) -> None:
    for option in GROUPS[group]:
        if option == "llama" and not HAS_TRANSFORMERS:
            continue  # tests/recipes/test_llama.py is skipped likewise
        cfg = _compose([f"{group}={option}"])
        resolved = OmegaConf.to_container(cfg.recipe, resolve=False)  # interpolations resolve below
        assert resolved
        if "root" in cfg.recipe.data:
            with open_dict(cfg):
                cfg.recipe.data.root = "/tmp/unused"  # ${hydra:runtime.cwd} needs a running app
        model = instantiate(cfg.recipe.model)
        data = instantiate(cfg.recipe.data)
        assert (hasattr(model, "layers") or hasattr(model, "model")) and hasattr(data, "train_dataloader")
        _check_keys(cfg)  # every shipped option holds only keys that something reads
        strategy, devices = build_strategy(cfg.strategy, cfg.trainer.devices)
        if cfg.strategy.name == "none":
            assert strategy == "auto" and devices == 1
        else:
            assert isinstance(strategy, PipelineStrategy) and strategy.schedule_name == cfg.strategy.schedule
        assert cfg.trainer.accelerator in ("cpu", "gpu")


def test_overrides_reach_the_strategy() -> None:
    cfg = _compose(["strategy=gpipe", "strategy.chunks=8", "strategy.balance=[3,1]", "strategy.recompute=always"])
    strategy, _ = build_strategy(cfg.strategy, 2)
    assert (strategy.schedule_name, strategy.chunks, strategy.balance, strategy.recompute) == (
        "gpipe",
        8,
        [3, 1],
        "always",
    )
    assert strategy.gradient_accumulation_fusion is True
    cfg = _compose(["strategy=pipedream_2bw", "strategy.gradient_accumulation_fusion=false"])
    assert build_strategy(cfg.strategy, 2)[0].gradient_accumulation_fusion is False
    cfg = _compose(["strategy=pipemare", "strategy.pipemare_warmup=50", "strategy.pipemare_correction=false"])
    config = build_strategy(cfg.strategy, 2)[0].config
    assert (config.schedule, config.pipemare_warmup, config.pipemare_correction) == ("pipemare", 50, False)
    config = build_strategy(_compose(["strategy=pipemare", "strategy.pipemare_decay=0.9"]).strategy, 2)[0].config
    assert (config.pipemare_decay, config.pipemare_correction) == (0.9, None)
    config = build_strategy(_compose(["strategy=xpipe", "strategy.xpipe_predictor=adam"]).strategy, 2)[0].config
    assert (config.schedule, config.xpipe_predictor, config.recompute) == ("xpipe", "adam", "never")
    cfg = _compose(
        [
            "strategy=1f1b",
            "strategy.stages=2",
            "strategy.data_parallel=shard",
            "trainer.devices=4",
            "strategy.check_data=5",
        ]
    )
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
    dualpipev = build_strategy(_compose(["strategy=dualpipev"]).strategy, 2)[0]
    assert (dualpipev.schedule_name, dualpipev.virtual_stages, dualpipev.config.chunks) == ("dualpipev", 2, None)
    izb = build_strategy(_compose(["strategy=interleaved_zero_bubble", "strategy.virtual_stages=4"]).strategy, 2)[0]
    assert (izb.schedule_name, izb.virtual_stages) == ("interleaved_zero_bubble", 4)
    assert build_strategy(_compose(["strategy=zero_bubble"]).strategy, 2)[0].virtual_stages == 1
    chimera = build_strategy(_compose(["strategy=chimera", "strategy.chunks=8"]).strategy, 2)[0]
    assert (chimera.schedule_name, chimera.virtual_stages, chimera.config.chunks) == ("chimera", 1, 8)
    with pytest.raises(ValueError, match="one stage per process"):
        build_strategy(_compose(["strategy=gpipe", "strategy.virtual_stages=2"]).strategy, 2)


def test_a_schedule_text_file_reaches_the_strategy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_pipe.cli import preflight

    monkeypatch.chdir(tmp_path)
    Path("mine.csv").write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    strategy = build_strategy(_compose(["strategy.schedule_text=mine.csv"]).strategy, 2)[0]
    assert (strategy.schedule_name, strategy.virtual_stages) == (str(tmp_path / "mine.csv"), 1)
    assert strategy.config.num_microbatches(2) == 2
    with pytest.warns(DeprecationWarning, match="schedule_text="):  # the former key still runs
        former = build_strategy(_compose(["strategy.schedule=mine.csv"]).strategy, 2)[0]
    assert former.config.schedule_text == str(tmp_path / "mine.csv")
    with pytest.raises(SystemExit, match=r"'other.csv': no such file"):
        preflight(["strategy.schedule_text=other.csv"])
    with pytest.raises(SystemExit, match=r"the schedule text 'mine.csv' runs 2 micro-batches per batch"):
        preflight(["strategy.schedule_text=mine.csv", "strategy.chunks=4"])


def test_a_bad_value_names_it() -> None:
    cfg = _compose(["strategy.schedule=zigzag"])
    with pytest.raises(ValueError, match="'zigzag'"):
        build_strategy(cfg.strategy, 2)


UNREAD_KEYS = [
    ("+strategy.chunk=4", (r"unknown key strategy.chunk \(did you mean strategy.chunks\?\): nothing reads it. "
                           r"Valid keys: balance, check_data, chunks, data_parallel, ")),
    ("+recipe.loss=mse", r"unknown key recipe.loss: nothing reads it. Valid keys: data, model, name."),
    ("+trainer.max_step=3", r"unknown key trainer.max_step \(did you mean trainer.max_steps\?\).*gradient_clip_val"),
    ("+trainer.logger=false", r"trainer.logger is set by lightning-pipe: choose it with logger=csv or "
                              r"logger=tensorboard"),
    ("+plan=auto", r"unknown key plan \(did you mean strategy.plan\?\): nothing reads it\. Valid keys: (?!.*plan_)"),
    ("+checkpoints=true", (r"unknown key checkpoints \(did you mean checkpoint\?\).*"
                           r"Valid keys: checkpoint, logger, recipe, resume, seed, strategy, timeline, trainer.$")),
]  # fmt: skip


@pytest.mark.parametrize(("override", "message"), UNREAD_KEYS, ids=[o for o, _ in UNREAD_KEYS])
def test_a_key_that_nothing_reads_fails_naming_the_valid_ones(override: str, message: str) -> None:
    """Hydra's own hint for a misspelt key is to add it with +; then it must not be ignored."""
    with pytest.raises(SystemExit, match=message):
        _check_keys(_compose([override]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "+recipe.model.hiden=64",
            r"unknown key recipe.model.hiden \(did you mean recipe.model.hidden\?\).*Valid keys: .*build",
        ),
        ("+recipe.data.batchsize=4", r"unknown key recipe.data.batchsize \(did you mean recipe.data.batch_size\?\)"),
    ],
)
def test_a_recipe_key_its_class_does_not_take_names_the_valid_ones(override: str, message: str) -> None:
    """Checked once Hydra has located the recipe's class (under its rules for config-named targets)."""
    from lightning_pipe.cli import instantiate_recipe

    part = override.split(".")[1]
    with pytest.raises(SystemExit, match=message):
        instantiate_recipe(_compose([override]), part)


def test_keys_that_something_reads_pass_and_run_checks_first(tmp_path: Path) -> None:
    from lightning_pipe.cli import instantiate_recipe

    # arguments of the recipe's class that its yaml leaves out, and any Trainer argument, may be added
    cfg = _compose(["+recipe.model.hidden=64", "+trainer.gradient_clip_val=1.0", "+plan_only=true"])
    _check_keys(cfg)
    assert instantiate_recipe(cfg, "model").hparams.hidden == 64
    with pytest.raises(SystemExit, match=r"unknown key strategy.chunks: nothing reads it. Valid keys: name."):
        _check_keys(_compose(["strategy=none", "+strategy.chunks=4"]))
    cfg = _compose(["+strategy.chunk=4"])
    with open_dict(cfg):
        del cfg.hydra
    with pytest.raises(SystemExit, match="strategy.chunk"):
        run(cfg, output_dir=str(tmp_path))  # before anything is built or started
    assert list(tmp_path.iterdir()) == []


def test_logger_choice(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lightning_pipe.cli import make_logger

    assert isinstance(make_logger("csv", tmp_path), CSVLogger)
    assert isinstance(make_logger("tensorboard", tmp_path), TensorBoardLogger)
    with pytest.raises(SystemExit, match="logger='wandb' is unknown. Valid: csv, tensorboard."):
        make_logger("wandb", tmp_path)


def test_tensorboard_gets_the_metrics_stage_metrics_and_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``logger=tensorboard``: the run's event file in its folder holds the recipe's values, every stage's
    metrics and (``timeline=true``) the timeline picture. The progress bar is TQDM's even where ``rich`` is
    installed (the ``hf`` extra brings it), whose bar Lightning would choose and which shows ``Epoch 2/-2``."""
    import lightning as L
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.trainer.connectors import callback_connector
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    made: list[L.Trainer] = []

    class Recorded(L.Trainer):
        @functools.wraps(L.Trainer.__init__)  # the command checks its keys against the signature
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(L, "Trainer", Recorded)
    monkeypatch.setattr(callback_connector, "_RICH_AVAILABLE", importlib.util.find_spec("rich") is not None)

    cfg = _compose(["logger=tensorboard", "timeline=true", *SMALL["bert_mlm"], *QUICK, "strategy.start_method=fork",
                    "strategy.chunks=2", "trainer.max_steps=2"])  # fmt: skip
    with open_dict(cfg):
        del cfg.hydra
    run(cfg, output_dir=str(tmp_path))
    (events,) = (tmp_path / "logs" / "version_0").glob("events.out.tfevents.*")
    tags = EventAccumulator(str(events)).Reload().Tags()
    for tag in ("train_loss", "val_loss", "samples_per_sec", "pipeline/stage0/bubble", "pipeline/stage1/bubble"):
        assert tag in tags["scalars"], tags
    assert tags["images"] == ["pipeline/timeline"]
    assert (tmp_path / "timeline.svg").is_file() and not (tmp_path / "logs" / "version_0" / "metrics.csv").exists()
    assert type(made[0].progress_bar_callback) is TQDMProgressBar


@pytest.mark.parametrize("recipe", ["vgg19_cifar100", "bert_mlm"])
@pytest.mark.parametrize("strategy", ["gpipe", "1f1b", "none", "zbv", "chimera"])
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
    return subprocess.run(
        [sys.executable, "-m", "lightning_pipe", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=280
    )


@pytest.mark.slow  # about 25 s: two jobs of two processes each
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
    assert "recipe: bert_mlm, llama, vgg19_cifar100" in lines and "trainer: cpu, gpu" in lines
    assert (
        "strategy: 1f1b, chimera, dualpipev, gpipe, interleaved_1f1b, interleaved_zero_bubble, none, pipedream, "
        "pipedream_2bw, pipeline, pipemare, wpipe, xpipe, zbv, zero_bubble" in lines
    )
    assert "powered by Hydra" not in result.stdout
    own = [k for k in OmegaConf.load(Path(CONFIG_DIR) / "config.yaml") if k not in ("defaults", "hydra")]
    assert sorted(own) == ["checkpoint", "logger", "resume", "seed", "timeline"]
    for key in own:  # every top-level key, with what it does
        assert any(line.startswith(f"  {key}=") and len(line.split()) > 3 for line in lines), key
    assert any(line.strip().startswith("lightning-pipe plan ") for line in lines)


def test_pipemare_runs_the_bert_recipe_with_its_options(tmp_path: Path) -> None:
    overrides = ["recipe=bert_mlm", "strategy=pipemare", "recipe.model.tie_embeddings=false",
                 "strategy.pipemare_warmup=2", "strategy.start_method=fork", "strategy.chunks=1", *SMALL["bert_mlm"],
                 *QUICK]  # fmt: skip
    cfg = _compose(overrides)
    with open_dict(cfg):
        del cfg.hydra
    metrics = run(cfg, output_dir=str(tmp_path))
    assert metrics["train_loss"] > 0 and "val_loss" in metrics


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
    assert "strategy=gpipe, 1f1b," in caplog.text and "dualpipev" in caplog.text and "wpipe" in caplog.text
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
    """The README's first-run command (shortened, with checkpoint=true) from an unrelated folder, --cfg job,
    and bad overrides; what the run shows: its folder first, the layout, a summary last, no empty log file,
    no warning asking for sync_dist."""
    result = _command([*SMALL["bert_mlm"], *QUICK, "hydra.run.dir=run", "checkpoint=true"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max_steps=3" in result.stderr + result.stdout
    folder = (tmp_path / "run").resolve()
    with open(folder / "logs" / "version_0" / "metrics.csv") as f:
        losses = [float(row["train_loss"]) for row in csv.DictReader(f) if row["train_loss"]]
    out = result.stdout.rstrip().splitlines()
    assert out[0] == f"lightning-pipe: output folder {folder}" and out.count(out[0]) == 1  # not the other process
    assert ("lightning-pipe: 2 stages (2 processes), layers per stage [2, 2], schedule 1f1b, 4 chunks; "
            "the model summary below counts rank 0's stage 0 only") in result.stderr.splitlines()  # fmt: skip
    assert out.count("lightning-pipe: run finished") == 1
    start = out.index("lightning-pipe: run finished")
    rows = dict(line.strip().split("  ", 1) for line in out[start + 1 : start + 8])
    rows = {name: value.strip() for name, value in rows.items()}
    assert rows["written"] == str(folder / "logs" / "version_0" / "metrics.csv")  # then the log files, one a line
    assert rows["output folder"] == str(folder) and rows["steps"] == "3"
    assert (
        rows["checkpoint"] == str(folder / "checkpoints" / "last.ckpt")
        and (folder / "checkpoints" / "last.ckpt").is_dir()
    )
    assert rows["final loss"] == f"{losses[-1]:.4f}"
    assert float(rows["wall time"].removesuffix(" s")) > 0 and float(rows["samples/s"].split()[0]) > 0
    assert all(log.stat().st_size > 0 for log in folder.glob("*.log"))  # no empty train_ddp_process_1.log
    assert "sync_dist=True" not in result.stderr
    shown = _command(["--cfg", "job", "recipe=vgg19_cifar100"], tmp_path)
    assert shown.returncode == 0 and "vgg19_cifar100" in shown.stdout
    # a new key added with +, as Hydra's own message for one suggests; under another logging choice of
    # Hydra's, into which the config's own (delayed) file handler merges
    added = _command(["+strategy.chunkz=3", "hydra/job_logging=stdout"], tmp_path)
    assert added.returncode != 0 and "Traceback" not in added.stderr
    assert added.stderr.startswith("lightning-pipe: unknown key strategy.chunkz (did you mean strategy.chunks?)")


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


def _vgg_run(folder: Path, *overrides: str) -> dict[str, float]:
    """3 steps per epoch of a small VGG on 2 forked processes, saving checkpoints at every validation (every 2
    steps); shuffled, with augmentation (crops and flips drawn from the sample and the epoch)."""
    cfg = _compose(["recipe=vgg19_cifar100", *SMALL["vgg19_cifar100"],
                    "recipe.data.synthetic_train=24", "trainer.max_steps=4",
                    "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "strategy.start_method=fork",
                    "strategy.chunks=2", "checkpoint=true", *overrides])  # fmt: skip
    with open_dict(cfg):
        cfg.recipe.data.root = str(folder / "data")
        del cfg.hydra
    return run(cfg, output_dir=str(folder))


def _consolidated(folder: Path) -> dict:
    import torch

    from lightning_pipe.checkpoint import consolidate

    consolidate(folder / "checkpoints" / "last.ckpt", folder / "whole.ckpt")
    return torch.load(folder / "whole.ckpt", weights_only=False)


def test_resume_continues_exactly_as_an_uninterrupted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``resume=`` gives ``fit`` the checkpoint, saved in the middle of an epoch: the optimizer's momentum, the LR
    schedule, the step and the epoch's shuffled order go on, and the weights after 4 steps (the rest of epoch 0
    and one step of epoch 1) equal those of a run that was never stopped."""
    import torch

    monkeypatch.chdir(tmp_path)
    _vgg_run(tmp_path / "whole")
    # stopped after 2 of the 4 steps, 2 of epoch 0's 3 (the schedule still planned for 4)
    _vgg_run(tmp_path / "outputs" / "first", "trainer.max_steps=2", "recipe.model.max_steps=4")
    assert _consolidated(tmp_path / "outputs" / "first")["global_step"] == 2
    _vgg_run(tmp_path / "second", "resume=last")  # the newest under outputs/
    whole, resumed = _consolidated(tmp_path / "whole"), _consolidated(tmp_path / "second")
    assert resumed["global_step"] == whole["global_step"] == 4
    assert whole["state_dict"].keys() == resumed["state_dict"].keys()
    for name, value in whole["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value, msg=name)
    (momentum,) = [s for s in whole["optimizer_states"]]
    for key, state in momentum["state"].items():
        torch.testing.assert_close(
            resumed["optimizer_states"][0]["state"][key]["momentum_buffer"], state["momentum_buffer"]
        )
    with pytest.raises(SystemExit, match=r"resume=nowhere: .* does not exist"):
        _vgg_run(tmp_path / "third", "resume=nowhere")


def _bert_run(folder: Path, *overrides: str) -> dict[str, float]:
    """4 steps per epoch of a tiny BERT (its default dropout, 0.1) on 2 forked processes, saving checkpoints at
    every validation (every 2 steps)."""
    cfg = _compose(["recipe=bert_mlm", *SMALL["bert_mlm"], "recipe.data.limit_chars=4000", "trainer.max_steps=6",
                    "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "strategy.start_method=fork",
                    "strategy.chunks=2", "checkpoint=true", *overrides])  # fmt: skip
    with open_dict(cfg):
        del cfg.hydra
    return run(cfg, output_dir=str(folder))


def test_bert_resumed_in_an_epoch_masks_and_drops_out_as_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved after 2 of epoch 0's 4 steps and resumed to step 6 (into epoch 1): the masks of a row come from the row
    and the epoch, each rank's dropout from its saved random state, so the weights equal the uninterrupted run's."""
    import torch

    monkeypatch.chdir(tmp_path)
    _bert_run(tmp_path / "whole")
    _bert_run(tmp_path / "outputs" / "first", "trainer.max_steps=2", "recipe.model.max_steps=6")
    _bert_run(tmp_path / "second", "resume=last")
    whole, resumed = _consolidated(tmp_path / "whole"), _consolidated(tmp_path / "second")
    assert resumed["global_step"] == whole["global_step"] == 6 and resumed["epoch"] == whole["epoch"] == 1
    for name, value in whole["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value, rtol=0, atol=0, msg=name)


def test_a_misspelt_key_is_named_with_its_close_key_before_hydra_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_pipe import cli

    monkeypatch.setattr(cli, "_main", lambda: pytest.fail("Hydra was reached"))
    for override, message in (("strategy.chunk=4", r"unknown key strategy.chunk \(did you mean strategy.chunks\?\)"),
                              ("trainer.max_step=3", r"unknown key trainer.max_step \(did you mean "
                                                     r"trainer.max_steps\?\)"),
                              ("chekpoint=true", r"unknown key chekpoint \(did you mean checkpoint\?\)"),
                              ("strategy.defaults=[]", r"unknown key strategy.defaults\."),
                              # the former name of recompute, which the command line no longer takes
                              ("strategy.checkpoint=always", r"unknown key strategy.checkpoint \(renamed: "
                                                             r"strategy.recompute\)"),
                              # a strategy or Trainer argument at the top level is sent to its node, and the
                              # planner's internal plan_only key is never suggested
                              ("plan=auto", r"unknown key plan \(did you mean strategy.plan\?\)"),
                              ("max_steps=3", r"unknown key max_steps \(did you mean trainer.max_steps\?\)"),
                              ("plan_onl=true", r"unknown key plan_onl\. Valid keys: (?!.*plan_only)")):  # fmt: skip
        monkeypatch.setattr(sys, "argv", ["lightning-pipe", "seed=1", override])
        with pytest.raises(SystemExit, match=message):
            cli.main()
    cli.check_overrides(["strategy=gpipe", "strategy.chunks=4", "trainer.max_steps=3", "resume=last", "hydra.run.dir=x",
                         "recipe.model.size=tiny", "+trainer.gradient_clip_val=1", "-m"])  # fmt: skip


def test_a_mistake_found_after_launch_prints_one_sentence_once(tmp_path: Path) -> None:
    """A balance that does not fit a model built in configure_model() is found in every process after the
    launch: rank 0 prints one sentence, no process prints a traceback, the run exits non-zero and the log
    file keeps the traceback."""
    result = _command(
        ["strategy.balance=[1,1]", "trainer.max_steps=1", "recipe.model.build=configure_model", *SMALL["bert_mlm"],
         "hydra.run.dir=run"], tmp_path,
    )  # fmt: skip
    assert "Initializing distributed" in result.stdout + result.stderr  # the processes had started
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("sums to 2 but the module has 4 layers") == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    logs = "".join(p.read_text() for p in (tmp_path / "run").glob("*.log"))
    assert "Traceback" in logs and "sums to 2" in logs


@pytest.mark.parametrize(
    "overrides, message, folder",
    [
        (["strategy.schedule=zigzag"], "Unknown pipeline schedule 'zigzag'. Valid schedules: 1f1b", False),
        pytest.param(
            ["logger=csvv"], "logger=csvv is unknown. Valid: csv, tensorboard.", False, marks=pytest.mark.slow
        ),
        pytest.param(
            ["strategy.balance=[1,1]", *SMALL["bert_mlm"]], "sums to 2 but the module has 4 layers", True,
            marks=pytest.mark.slow,
        ),
        pytest.param(["trainer.devices=6", *SMALL["bert_mlm"]], "cannot split 4 layers into 6 stages", True,
                     marks=pytest.mark.slow),
        pytest.param(["recipe=vgg19_cifar100", "recipe.data.source=cifar100", "recipe.data.root=nowhere"],
         "CIFAR-100 is not in", True, marks=pytest.mark.slow),
    ],
    ids=["bad-schedule", "bad-logger", "bad-balance", "too-many-devices", "missing-data"],
)  # fmt: skip
def test_a_mistake_found_before_launch_starts_no_process(
    tmp_path: Path, overrides: list[str], message: str, folder: bool
) -> None:
    """What the configuration, the model or the data shows to be wrong fails on the launching process:
    one sentence, no traceback, no other process started; a bad configuration value fails before Hydra
    creates the run's folder."""
    result = _command([*overrides, "trainer.max_steps=1"], tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count(message) == 1, output[-3000:]
    assert "Traceback" not in output and "Initializing distributed" not in output, output[-3000:]
    assert (tmp_path / "outputs").exists() == folder


def test_library_deprecations_and_tips_are_silenced_in_command_line_runs() -> None:
    """A command-line user cannot act on Lightning's and torch's warnings about each other's internals,
    nor on Lightning's advertising tips; warnings from other code still show."""
    import logging
    import warnings

    from lightning_pipe.cli import quiet_libraries

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_libraries()
        message = "`isinstance(treespec, LeafSpec)` is deprecated"
        warnings.warn_explicit(message, FutureWarning, "_pytree.py", 21, module="lightning.pytorch.utilities._pytree")
        warnings.warn_explicit("old", DeprecationWarning, "x.py", 1, module="torch.distributed.x")
        warnings.warn_explicit("yours", DeprecationWarning, "y.py", 1, module="my_project.model")
    assert [str(w.message) for w in caught] == ["yours"]
    tip = logging.LogRecord("lightning.pytorch.utilities.rank_zero", logging.INFO, "", 0, "💡 Tip: ...", None, None)
    assert not logging.getLogger("lightning.pytorch.utilities.rank_zero").filter(tip)


def test_preflight_refuses_bad_values_before_hydra_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The composed configuration alone shows these wrong: refused before Hydra creates the run's folder."""
    from lightning_pipe.cli import preflight

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # a run's folder whose last.ckpt is gone
    (tmp_path / "run" / "checkpoints" / "epoch=0-step=3.ckpt").write_bytes(b"")
    for overrides, message in (
        (["strategy.schedule=zigzag"], r"Unknown pipeline schedule 'zigzag'"),
        (["logger=csvv"], r"logger=csvv is unknown"),
        (["resume=nowhere"], r"resume=nowhere: .* does not exist"),
        (
            ["resume=run"],
            r"resume=run: .*run is a folder, not a checkpoint: a lightning-pipe checkpoint is a folder holding meta.pt "
            r".* Checkpoints in it: checkpoints/epoch=0-step=3.ckpt\. .*its checkpoints/last.ckpt, which this one does "
            "not have",
        ),
        (["+strategy.chunkz=3"], r"unknown key strategy.chunkz \(did you mean strategy.chunks\?\)"),
    ):
        with pytest.raises(SystemExit, match=message):
            preflight(overrides)
    preflight(["strategy=zbv", "trainer.devices=2"])  # valid: nothing raised
    preflight(["-m", "strategy.schedule=zigzag"])  # a sweep: left to Hydra
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("schedule", ["pipedream", "pipemare", "xpipe"])
def test_tied_weights_across_stages_are_refused_naming_the_schedule(schedule: str) -> None:
    from lightning_pipe.cli import check_tied_weights
    from tests.models import TiedNet

    cfg = OmegaConf.create(
        {
            "strategy": {"name": "pipeline", "schedule": schedule, "balance": None, "module": None},
            "recipe": {"model": {}},
        }
    )
    with pytest.raises(
        SystemExit, match=rf"strategy.schedule={schedule} cannot train weights shared .*layers\.0\.weight"
    ):
        check_tied_weights(cfg, TiedNet(), 2)
    check_tied_weights(OmegaConf.merge(cfg, {"strategy": {"schedule": "pipedream_2bw"}}), TiedNet(), 2)  # 2BW ties
