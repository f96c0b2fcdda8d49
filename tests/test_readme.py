"""The README's first Python example under "Use" runs as written: copied into a file in an empty
folder and run with ``python`` on a CPU-only machine."""

from __future__ import annotations

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
    script = tmp_path / "train.py"
    script.write_text(readme_example())
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "PYTHONPATH")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # as on a machine without a GPU
    result = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_epochs=5` reached." in result.stderr + result.stdout
