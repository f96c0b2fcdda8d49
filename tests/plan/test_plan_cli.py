"""``lightning-pipe plan <overrides>``: ranks the layouts of the configured run and stops."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

SMALL_VGG = ["recipe=vgg19_cifar100", "recipe.model.width=0.125", "recipe.data.synthetic_train=96",
             "recipe.data.synthetic_val=32", "recipe.data.batch_size=8"]  # fmt: skip


@pytest.mark.slow  # about 20-55 s on 2 cores (more under load): the script launcher starts fresh interpreters
def test_plan_command_writes_the_ranking_and_the_predicted_timelines(tmp_path: Path) -> None:
    """The command as a user runs it: the table printed once (the strategy's log does not repeat it),
    the last line printed names what was written, no model summary; plan.svg's titles fit."""
    from lightning_pipe.schedules.timeline_svg import _LEFT, _TITLE_CHAR

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [sys.executable, "-m", "lightning_pipe", "plan", *SMALL_VGG, "hydra.run.dir=run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "run" / "plan.txt").read_text()
    lines = text.splitlines()
    assert lines[0].startswith("measured link between ranks 0 and 1: latency ")
    assert lines[2].split()[:4] == ["#", "schedule", "chunks", "balance"] and len(lines) == 3 + 5 + 2
    assert (result.stdout + result.stderr).count(lines[2]) == 1 and text in result.stdout
    assert result.stdout.rstrip().splitlines()[-1].startswith("written: ")
    assert "Trainable params" not in result.stdout + result.stderr
    root = ET.parse(tmp_path / "run" / "plan.svg").getroot()
    width = float(root.get("width", "0"))
    panels = [g for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "panel"]
    assert len(panels) == 3 and panels[0].get("data-title", "").startswith("#1: ")
    for panel in panels:
        titles = [t.text or "" for t in panel.iter("{http://www.w3.org/2000/svg}tspan")]
        assert all(_LEFT + len(t) * _TITLE_CHAR <= width for t in titles), titles
    assert (
        not (tmp_path / "run" / "logs" / "version_0" / "metrics.csv").exists()
        or "train_loss" not in (tmp_path / "run" / "logs" / "version_0" / "metrics.csv").read_text()
    )  # stopped before the first training step


def test_plan_only_and_timeline_options_of_a_run(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """What ``lightning-pipe plan`` and ``lightning-pipe timeline=true strategy=zero_bubble`` do, in
    this process (fork): the plan printed once with the overrides that run its first choice (which
    the command line accepts), nothing after it that looks like training; the timeline predicted and
    measured."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from lightning_pipe.cli import CONFIG_DIR, build_strategy, run

    small = ["recipe.data.limit_chars=40000", "recipe.data.max_len=32", "recipe.data.vocab_size=500",
             "recipe.data.batch_size=8", "trainer.max_steps=2", "trainer.limit_val_batches=1",
             "strategy.start_method=fork"]  # fmt: skip

    def compose_run(overrides: list[str]) -> Any:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        with open_dict(cfg):
            del cfg.hydra
        return cfg

    metrics = run(compose_run(small + ["strategy.plan=auto", "+plan_only=true"]), output_dir=str(tmp_path / "plan"))
    assert "train_loss" not in metrics  # stopped before the first step
    out, err = capfd.readouterr()
    text = (tmp_path / "plan" / "plan.txt").read_text()
    header = text.splitlines()[3]  # after the link's and the rank speeds' lines and the count
    assert (out + err).count(header) == 1 and text in out  # the table printed once, all of plan.txt with it
    assert (
        out.rstrip().splitlines()[-1].startswith("written: ") and "Trainable params" not in out + err + caplog.text
    )  # no model summary
    assert "layers per stage" not in out + err + caplog.text  # no layout line that reads as a run of the schedule
    lines = text.splitlines()
    assert re.fullmatch(
        r"measured link between ranks 0 and 1: latency [0-9.]+ us, bandwidth ([0-9]+ MB/s|not resolved .*)", lines[0]
    ), lines[0]
    assert lines[1].startswith("rank speeds relative to rank 0"), lines[1]
    best = lines[4].split()
    if best[2].startswith("v"):  # an interleaved schedule's label names its virtual stages: "zbv v2"
        best = [best[0], best[1], *best[3:]]
    assert header.split()[:4] == ["#", "schedule", "chunks", "balance"] and best[0] == "1"
    assert lines[-3].startswith("best: #1, " + best[1])
    run_it = lines[-2]
    assert lines[-1].startswith("activations per stage (predicted peak MiB of saved tensors): stage 0 keep ")
    assert run_it.startswith("run it with: strategy=" + best[1] + " strategy.chunks=" + best[2])
    cfg = compose_run(small + shlex.split(run_it.removeprefix("run it with: ")))  # the printed overrides are accepted
    strategy, _ = build_strategy(cfg.strategy, cfg.trainer.devices)
    assert (strategy.schedule_name, strategy.chunks) == (best[1], int(best[2]))
    assert (tmp_path / "plan" / "plan.svg").read_text().count('class="panel"') == 3

    run(compose_run(small + ["timeline=true", "strategy=zero_bubble"]), output_dir=str(tmp_path / "timeline"))
    svg = (tmp_path / "timeline" / "timeline.svg").read_text()
    assert ">rank 0<" in svg and ">rank 1<" in svg
    assert "zero_bubble: predicted from each stage" in svg and "zero_bubble: measured, the last training step" in svg


@pytest.mark.parametrize(
    "overrides", [["trainer.devices=1"], ["trainer.devices=2", "strategy.stages=1"]], ids=["one process", "one stage"]
)
def test_plan_with_nothing_to_rank_says_so(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], overrides: list[str]
) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from lightning_pipe.cli import CONFIG_DIR, run

    small = ["recipe.data.limit_chars=40000", "recipe.data.max_len=32", "recipe.data.vocab_size=500",
             "recipe.data.batch_size=8", "trainer.max_steps=2", "strategy.start_method=fork"]  # fmt: skip
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=small + overrides + ["strategy.plan=auto", "+plan_only=true"],
            return_hydra_config=True,
        )
    with open_dict(cfg):
        del cfg.hydra
    metrics = run(cfg, output_dir=str(tmp_path))
    assert "train_loss" not in metrics and not (tmp_path / "plan.txt").exists()
    out = capfd.readouterr().out
    processes = 1 if "trainer.devices=1" in overrides else 2
    assert (
        "lightning-pipe plan: nothing to rank: the planner needs a pipeline of at least 2 stages, and this run has 1 "
        f"on {processes} " in out
    )
