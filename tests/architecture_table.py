"""docs/architecture.md's module table, written from the code: every module of the package with the first
sentence of its docstring, folder by folder. ``python -m tests.architecture_table`` rewrites the table;
tests/test_docs.py fails where the page's table differs, so it cannot drift from the modules."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE, PAGE = ROOT / "lightning_pipe", ROOT / "docs" / "architecture.md"
BEGIN = "<!-- the modules: written by `python -m tests.architecture_table` from their docstrings -->"
END = "<!-- end of the modules -->"


def first_sentence(doc: str) -> str:
    """A docstring's first sentence (to its first full stop followed by a space), on one line, pipes escaped."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", " ".join(doc.split())).replace("``", "`")
    match = re.search(r"(?<!e\.g)(?<!i\.e)(?<!\bvs)\.(\s|$)", text)
    return (text[: match.start() + 1] if match else text).replace("|", "\\|")


def table() -> str:
    """The table between :data:`BEGIN` and :data:`END`: a row per module, a folder's ``__init__`` first."""
    rows = [BEGIN, "| module | what it is for (its docstring's first sentence) |", "|---|---|"]
    order = sorted(
        PACKAGE.rglob("*.py"), key=lambda p: (p.parent.relative_to(PACKAGE).parts, p.name != "__init__.py", p.name)
    )
    for path in order:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc is None:
            continue
        rows.append(f"| `{path.relative_to(PACKAGE).as_posix()}` | {first_sentence(doc)} |")
    return "\n".join([*rows, END])


def with_table(page: str) -> str:
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + table() + page[end:]


if __name__ == "__main__":
    PAGE.write_text(with_table(PAGE.read_text()))
    sys.exit(0)
