"""The README's and the docs' Python examples run as written: the first under "Use" copied into a file in an empty
folder and run with ``python`` on a CPU-only machine; the safetensors one in this process."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)


def readme_example() -> str:
    """The first ```python block of the README's "## Use" section."""
    text = (ROOT / "README.md").read_text()
    use = text.index("\n## Use\n")
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, use)
    assert match is not None, "no python block under '## Use'"
    return match.group(1)


def test_readme_example_runs_as_written(tmp_path: Path) -> None:
    """One epoch of the five: ``.ci/run`` runs all five against the installed wheel before the tests."""
    script = tmp_path / "train.py"
    example = readme_example()
    assert example.count("max_epochs=5") == 2  # the 2-process Trainer's and the commented 4-GPU one's
    script.write_text(example.replace("max_epochs=5", "max_epochs=1"))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "PYTHONPATH")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # as on a machine without a GPU
    result = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stderr + result.stdout
    assert "`Trainer.fit` stopped: `max_epochs=1` reached." in output
    # where Lightning prints its setup lines, without any logging set up by the script
    layout = ("lightning-pipe: 2 stages (2 processes), layers per stage [4, 3], schedule 1f1b, 4 chunks, global batch "
              "64; the model summary below counts rank 0's stage 0 only")  # fmt: skip
    assert layout in result.stderr.splitlines()
    assert "train_loss" in result.stdout  # prog_bar=True: in the progress bar
    assert "log_every_n_steps" not in output  # no warning that 32 batches never reach the logging interval


def guide_text() -> str:
    """The README and every page of the docs site."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n".join(page.read_text() for page in pages)


def readme_block(containing: str) -> str:
    """The ```python block of the README or the docs that contains ``containing``."""
    blocks = re.compile(r"```python\n(.*?)```", re.S).findall(guide_text())
    (block,) = [b for b in blocks if containing in b]
    return block


def test_a_tied_model_saved_as_the_readme_shows_loads_through_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``safetensors.torch.save_model`` (``save_file`` refuses tied weights) as the README writes it; the
    file starts a 2-stage pipeline, each stage with the saved values, and rank 0 says what it loaded."""
    import lightning as L
    import torch
    from safetensors.torch import save_file

    from lightning_pipe import PipelineStrategy
    from tests.models import SaveStageState, TiedNet, merged_stage_states, token_loader
    from tests.pipeline import fit_pipeline

    monkeypatch.chdir(tmp_path)
    saved = TiedNet()
    with pytest.raises(RuntimeError, match="share memory"):
        save_file(saved.state_dict(), "refused.safetensors")
    namespace = {"model": saved, "L": L, "PipelineStrategy": PipelineStrategy}
    exec(readme_block("save_model("), namespace)
    assert namespace["trainer"].strategy.weights == "model.safetensors"
    messages = tmp_path / "rank0.log"
    handler = logging.FileHandler(messages)  # the forked ranks inherit it
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        fit_pipeline(TiedNet(), 2, token_loader(), weights="model.safetensors", max_steps=1,
                     callbacks=[SaveStageState(str(tmp_path), start=True)])  # fmt: skip
    finally:
        logger.removeHandler(handler)
        handler.close()
    started = merged_stage_states(str(tmp_path), 2, start=True)
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(started[name], value, rtol=0, atol=0, msg=name)
    lines = messages.read_text().splitlines()
    assert ("lightning-pipe: rank 0 loaded 3 of the 3 tensors in model.safetensors (its stage's and those outside "
            "the Sequential; the other ranks read theirs)") in lines, lines  # fmt: skip


def test_the_bring_your_own_model_example_runs_as_written(tmp_path: Path) -> None:
    """The Hugging Face GPT-2 example, unchanged, on 2 processes launched as a script."""
    pytest.importorskip("transformers")
    script = tmp_path / "causal_lm.py"
    script.write_text(readme_block('module="model.transformer.h"'))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "PYTHONPATH")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(
        [sys.executable, "causal_lm.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_epochs=2` reached." in result.stderr + result.stdout
    assert "lightning-pipe: 2 stages (2 processes), layers per stage [2, 2]" in result.stderr
    assert "bos_token_id must be" not in result.stderr and "eos_token_id must be" not in result.stderr  # config


def four_device_example() -> str:
    """The "## Use" example with its "On 4 GPUs" Trainer in place of the 2-process one, on CPU, for 8 steps."""
    lines = readme_example().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# On 4 GPUs"))
    block = [line[2:] for line in lines[start + 1 :] if line.startswith("# ")]
    stop = start + 1 + len(block)
    assert lines[stop - 1] == "# )", "the commented Trainer ends with '# )'"
    text = "\n".join(block).replace('accelerator="gpu"', 'accelerator="cpu"')
    # 8 steps of the 5 x 32: the 2-process run above trains; this one proves the 4-stage split and launch
    text = text.replace("max_epochs=5", "max_epochs=1, limit_train_batches=8")
    assert 'accelerator="cpu"' in text and "devices=4" in text and "limit_train_batches=8" in text
    return "\n".join(lines[:start] + [text] + lines[stop:]) + "\n"


@pytest.mark.timeout(400)
def test_the_four_device_example_runs_as_written_on_cpu(tmp_path: Path) -> None:
    """Every stage of the 4-stage split holds a parameter (a lone ReLU would give its optimizer an
    empty parameter list)."""
    (tmp_path / "train.py").write_text(four_device_example())
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "PYTHONPATH")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=390
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_epochs=1` reached." in result.stderr + result.stdout
    layout = [line for line in result.stderr.splitlines() if line.startswith("lightning-pipe: 4 stages")]
    assert layout and "layers per stage [2, 2, 2, 1], schedule 1f1b, 8 chunks" in layout[0], result.stderr[-3000:]
