"""The package installs the way users install it: a wheel built from the checkout's files holds every module
of the tree, the Hydra configuration and the command (``.ci/run`` installs that wheel in a fresh environment and
runs the README's first run and Python example against it, before the tests)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_pipe"
pytestmark = pytest.mark.timeout(240)


def _build_wheel(out: Path) -> Path:
    """The wheel of a copy of the files a source distribution carries (no network: the build backend
    installed beside the tests, run as pip would run it)."""
    source = out / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(PACKAGE, source / "lightning_pipe", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"],
        cwd=source, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    return out / built.stdout.strip().splitlines()[-1]


def test_the_wheel_holds_every_module_the_configuration_and_the_command(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", minversion="77")
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    configs = {str(p.relative_to(ROOT)) for p in (PACKAGE / "conf").rglob("*.yaml")}
    assert len(tree) > 140 and "lightning_pipe/recipes/bert.py" in tree and "lightning_pipe/conf/config.yaml" in configs
    assert sorted(tree - names) == [] and sorted(configs - names) == []
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "lightning-pipe = lightning_pipe.command:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
