"""The guide stays a guide: no dates or clock times on its pages, at most 120 KB in all, and every code block
on them either runs here, is run by the test it names, or is marked as not meant to run.

A code block is a ```python or ```bash fence; the line before it says what to do with it:

- ``<!-- run -->``: executed in this process (in an empty folder), after the imports every page assumes;
- ``<!-- script -->`` / ``<!-- script slow -->``: written to ``train.py`` in an empty folder and run with
  ``python``, as a user runs it; a ``lightning-pipe: ...`` line the page quotes after it must be printed;
- ``<!-- tested: tests/FILE.py -->``: another test runs it (that file must read the page's block);
- ``<!-- no-run: why -->``: not run (a fragment, or it needs GPUs, nodes or downloads); counted below.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: the pages that are no part of the guide: measurements, the test suite, the code's structure
NOT_GUIDE = {"benchmarks.md", "testing.md", "architecture.md"}
#: the guide's size limit, in bytes
GUIDE_BYTES = 120_000
#: blocks marked not to run, per page: a change here is a deliberate one
NOT_RUN = {
    "bring-your-own-model.md": 3,
    "command-line.md": 2,
    "custom-schedule.md": 1,
    "elastic.md": 2,
    "index.md": 6,
    "large-models.md": 1,
    "models.md": 3,
    "observe.md": 3,
    "quickstart.md": 4,
    "training.md": 2,
    "usage.md": 1,
}
DATES = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bUTC\b|\b\d\d:\d\d(:\d\d)? (UTC|GMT)\b")
FENCE = re.compile(r"^([ \t]*)```([\w-]*)[^\n]*\n(.*?)^\1```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(run|script slow|script|tested:\s*\S+|no-run(?::[^>]*)?)\s*-->\s*$")
CODE = {"python", "bash", "sh"}
PRELUDE = """
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import lightning_pipe
from lightning_pipe import PipelineStrategy
"""


def guide_pages() -> list[Path]:
    return sorted(p for p in DOCS.glob("*.md") if p.name not in NOT_GUIDE)


@dataclass(frozen=True)
class Block:
    page: str
    index: int
    language: str
    marker: str  # "" when the line before the fence has none
    code: str
    after: str  # the page's text after the block

    @property
    def id(self) -> str:
        return f"{self.page}:{self.index}"


def blocks(page: Path) -> list[Block]:
    return blocks_of(page.read_text(), page.name)


def blocks_of(text: str, name: str) -> list[Block]:
    """The fenced blocks of a page's ``text``, each with the marker on the line before it."""
    found = []
    for i, match in enumerate(FENCE.finditer(text)):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        indent = match.group(1)
        code = "\n".join(line[len(indent) :] for line in match.group(3).splitlines()) + "\n"
        mark = marker.group(1).strip() if marker else ""
        found.append(Block(name, i, match.group(2), mark, code, text[match.end() :]))
    return found


def code_blocks() -> list[Block]:
    return [b for page in guide_pages() for b in blocks(page) if b.language in CODE]


def block_tested_by(page: str, test_file: str) -> str:
    """The code of ``page``'s one block marked ``<!-- tested: test_file -->``: what that test runs."""
    (block,) = [b for b in blocks(DOCS / page) if b.marker == f"tested: {test_file}"]
    return block.code


def test_the_guide_pages_carry_no_dates_or_clock_times() -> None:
    found = [
        f"{page.name}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
        for page in guide_pages()
        for text in [page.read_text()]
        for m in DATES.finditer(text)
    ]
    assert not found, f"dates belong in docs/benchmarks.md with their figures: {found}"


def test_the_guide_is_at_most_120_kb() -> None:
    sizes = {page.name: len(page.read_bytes()) for page in guide_pages()}
    assert sum(sizes.values()) <= GUIDE_BYTES, f"{sum(sizes.values())} bytes > {GUIDE_BYTES}: {sizes}"
    assert {"quickstart.md", "coming-from.md", "index.md"} <= set(sizes)


def test_the_date_pattern_and_the_fences_are_read_as_meant() -> None:
    assert DATES.search("measured on 2026-11-28") and DATES.search("since 13:43 UTC")
    assert not DATES.search("outputs/DATE/TIME/, 2 x 2 replicas, 20 steps")
    page = "text\n\n<!-- no-run: a fragment -->\n```python\nx = 1\n```\n\n  <!-- run -->\n  ```bash\n  ls\n  ```\n"
    first, second = blocks_of(page, "probe.md")
    assert (first.language, first.marker, first.code) == ("python", "no-run: a fragment", "x = 1\n")
    assert (second.language, second.marker, second.code) == ("bash", "run", "ls\n")


def test_every_code_block_is_run_or_marked_and_the_unrun_ones_are_counted() -> None:
    unmarked = [b.id for b in code_blocks() if not b.marker]
    markers = "<!-- run -->, <!-- script -->, <!-- tested: FILE --> or <!-- no-run: why -->"
    assert not unmarked, f"mark each with {markers}: {unmarked}"
    counts: dict[str, int] = {}
    for b in code_blocks():
        if b.marker.startswith("no-run"):
            counts[b.page] = counts.get(b.page, 0) + 1
    assert counts == NOT_RUN
    run = [b for b in code_blocks() if not b.marker.startswith("no-run")]
    assert len(run) > sum(NOT_RUN.values()) // 2, "most of the guide's code should run"


@pytest.mark.parametrize("block", [b for b in code_blocks() if b.marker.startswith("tested:")], ids=lambda b: b.id)
def test_a_block_another_test_runs_is_read_by_that_test(block: Block) -> None:
    path = ROOT / block.marker.split(":", 1)[1].strip()
    assert path.is_file(), path
    source = path.read_text()
    assert f'"{block.page}"' in source or 'docs").glob' in source or 'glob("*.md")' in source, path


@pytest.mark.parametrize("block", [b for b in code_blocks() if b.marker == "run"], ids=lambda b: b.id)
def test_a_block_runs_as_written(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert block.language == "python", "only python blocks run in this process"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    exec(compile(PRELUDE, "<prelude>", "exec"), namespace)
    exec(compile(block.code, block.id, "exec"), namespace)


def _scripts() -> list[object]:
    return [
        pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.marker == "script slow" else [])
        for b in code_blocks()
        if b.marker.startswith("script")
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", _scripts())
def test_a_script_runs_as_written(block: Block, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(block.code)
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=290
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "`Trainer.fit` stopped" in output, output[-3000:]
    quoted = re.search(r"`(lightning-pipe: [^`]*?)(?:, \.\.\.)?`", block.after.split("```", 1)[0])
    if quoted:  # the line the page says the run prints
        line = " ".join(quoted.group(1).split())  # as printed: on one line
        assert line in output, (line, output[-3000:])


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading (its default ``slugify``)."""
    text = re.sub(r"[^\w\s-]", "", re.sub(r"`", "", heading)).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_the_readmes_links_into_the_docs_reach_a_page_and_a_heading() -> None:
    """mkdocs --strict checks the links between the docs' pages; the README's are checked here."""
    broken = []
    for page, anchor in re.findall(r"\]\(docs/([\w-]+\.md)(?:#([\w-]+))?\)", (ROOT / "README.md").read_text()):
        path = DOCS / page
        headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)} if path.is_file() else set()
        if not path.is_file() or (anchor and anchor not in headings):
            broken.append(f"docs/{page}#{anchor}")
    assert _slug("Skip connections in an `nn.Sequential`") == "skip-connections-in-an-nnsequential"
    assert not broken, broken


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_site_and_its_api_reference_build_under_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict``: every link and anchor between the pages resolves, and mkdocstrings finds every
    object the API reference names (the ``docs`` extra)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = dict(os.environ, PYTHONPATH=str(ROOT), NO_MKDOCS_2_WARNING="1")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=290)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert all(name in reference for name in ("token_count", "skippable", "format_schedule", "consolidate"))


def test_the_architecture_pages_module_table_is_written_from_the_modules() -> None:
    from tests.architecture_table import PAGE, first_sentence, with_table

    page = PAGE.read_text()
    assert page == with_table(page), "run python -m tests.architecture_table"
    assert "| `runtime/executor.py` |" in page
    assert first_sentence("Walks the actions, e.g. sends. Then more.") == "Walks the actions, e.g. sends."


def test_every_module_path_the_architecture_page_names_exists() -> None:
    from tests.architecture_table import BEGIN, END, PACKAGE, PAGE, ROOT

    text = PAGE.read_text()
    page = text[: text.index(BEGIN)] + text[text.index(END) :]  # the prose; the table is the modules' own
    named = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", page))
    beside = ("tests/", "benchmarks/")  # files beside the package the prose names by their full path
    missing = sorted(
        n for n in named if not n.startswith(beside) and not list(PACKAGE.rglob(n)) and not (ROOT / n).exists()
    )
    assert len(named) > 20 and not missing, missing
