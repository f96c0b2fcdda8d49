"""``lightning-pipe plan <overrides>``: ranks the layouts of the configured run and stops."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

SMALL_VGG = ["recipe=vgg19_cifar100", "recipe.model.width=0.125", "recipe.data.synthetic_train=96",
             "recipe.data.synthetic_val=32", "recipe.data.batch_size=8"]  # fmt: skip


@pytest.mark.slow  # about 20-35 s on 2 cores: the script launcher starts fresh interpreters
def test_plan_command_writes_the_ranking_and_the_predicted_timelines(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [sys.executable, "-m", "lightning_pipe", "plan", *SMALL_VGG, "hydra.run.dir=run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "run" / "plan.txt").read_text().splitlines()
    assert table[0].split()[:4] == ["#", "schedule", "chunks", "balance"] and len(table) == 6
    assert table[1] in result.stdout
    root = ET.parse(tmp_path / "run" / "plan.svg").getroot()
    panels = [g for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "panel"]
    assert len(panels) == 3 and panels[0].get("data-title", "").startswith("#1: ")
    assert not (tmp_path / "run" / "logs" / "version_0" / "metrics.csv").exists() or "train_loss" not in (
        tmp_path / "run" / "logs" / "version_0" / "metrics.csv"
    ).read_text()  # stopped before the first training step


def test_plan_only_and_timeline_options_of_a_run(tmp_path: Path) -> None:
    """What ``lightning-pipe plan`` and ``lightning-pipe timeline=true`` do, in this process (fork)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from lightning_pipe.cli import CONFIG_DIR, run

    small = ["recipe.data.limit_chars=40000", "recipe.data.max_len=32", "recipe.data.vocab_size=500", "recipe.data.batch_size=8",
             "trainer.max_steps=2", "trainer.limit_val_batches=1", "strategy.start_method=fork"]  # fmt: skip
    for name, extra in (("plan", ["strategy.plan=auto", "+plan_only=true"]), ("timeline", ["timeline=true"])):
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=small + extra, return_hydra_config=True)
        with open_dict(cfg):
            del cfg.hydra
        metrics = run(cfg, output_dir=str(tmp_path / name))
        if name == "plan":
            assert "train_loss" not in metrics  # stopped before the first step
            assert (tmp_path / "plan" / "plan.txt").read_text().startswith(" # schedule")
            assert (tmp_path / "plan" / "plan.svg").read_text().count('class="panel"') == 3
        else:
            svg = (tmp_path / "timeline" / "timeline.svg").read_text()
            assert ">rank 0<" in svg and ">rank 1<" in svg and "measured, the last training step" in svg
