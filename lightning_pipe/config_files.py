"""The files written from :mod:`lightning_pipe.config`'s fields: ``lightning_pipe/conf/strategy/pipeline.yaml``, the
arguments table of ``docs/usage.md``, :class:`~lightning_pipe.config.PipelineConfig`'s typed flat reads and
``PipelineStrategy``'s typed keywords (:mod:`lightning_pipe.arguments`). ``python -m lightning_pipe.config_files``
rewrites them; ``--check`` fails where one differs (tests/test_config_files.py runs the check), so an argument is
written once, in its field."""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lightning_pipe.command_keys import DEPRECATED
from lightning_pipe.config import Argument, PipelineConfig, argument_groups, arguments, group_fields

ROOT = Path(__file__).resolve().parents[1]
YAML = Path("lightning_pipe/conf/strategy/pipeline.yaml")
DOCS = Path("docs/usage.md")
CONFIG = Path("lightning_pipe/config.py")
ARGUMENTS = Path("lightning_pipe/arguments.py")
FLAT_BEGIN = "    # the flat reads, typed: written by `python -m lightning_pipe.config_files` from the groups' fields\n"
FLAT_END = "    # end of the flat reads\n"
BEGIN = "<!-- the arguments: written by `python -m lightning_pipe.config_files` from lightning_pipe/config.py -->"
END = "<!-- end of the arguments -->"
YAML_HEADER = """\
# PipelineStrategy's arguments, each once, with Python's defaults (PipelineStrategy() == strategy=pipeline; a
# schedule's file starts from this one: `defaults: [pipeline, _self_]` and sets what differs). null: the value the
# strategy computes, as in Python. Written by `python -m lightning_pipe.config_files` from lightning_pipe/config.py:
# change the field there, not this file.
name: pipeline
"""


def plain(text: str) -> str:
    """Markdown as the YAML's plain text: links by their words, code without its backticks, Python's
    constants as YAML's."""
    for python, yaml in (("`True`", "true"), ("`False`", "false"), ("`None`", "null"), (" (default)", "")):
        text = text.replace(python, yaml)
    return re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", text).replace("`", "")


def short_meaning(doc: str, most: int = 90) -> str:
    """The doc's leading phrase (up to its first full stop, colon, semicolon or bracket): a YAML comment's lead."""
    phrase = re.split(r"\. |: |; | \(", " ".join(doc.split()), maxsplit=1)[0].rstrip(".")
    return plain(phrase) + ": " if len(phrase) <= most else ""


def _python(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _yaml(value: Any) -> str:
    return {None: "null", True: "true", False: "false"}.get(value, str(value)) if not isinstance(value, str) else value


def values_cell(argument: Argument) -> str:
    """The docs table's values: the allowed values with the default marked, and what ``None`` becomes."""
    default, unset, values = argument.default, argument.unset, argument.values
    stated = f" (default `None`: {unset})" if default is None and unset else f" (default `{_python(default)}`)"
    if isinstance(values, str):
        return values + argument.more + ("" if "(default" in values else stated)
    listed = [v == default and type(v) is type(default) for v in values]
    marked = f" (default: {unset})" if default is None and unset else " (default)"
    cells = [f"`{_python(v)}`" + (marked if is_default else "") for v, is_default in zip(values, listed)]
    return ", ".join(cells) + argument.more + ("" if any(listed) else stated)


def docs_table(config: type = PipelineConfig) -> str:
    """docs/usage.md's table of the arguments, between :data:`BEGIN` and :data:`END`."""
    rows = ["| argument | values | meaning |", "|---|---|---|"]
    for a in arguments(config):
        rows.append(f"| `{a.name}` | {values_cell(a)} | {' '.join(a.doc.split())} |")
    return "\n".join([BEGIN, *rows, END])


def yaml_comment(argument: Argument) -> str:
    values, default = argument.values, argument.default
    said = plain(values) if isinstance(values, str) else " | ".join(_yaml(v) for v in values)
    more = plain(argument.more)
    said += " | or" + more[4:] if more.startswith((", or", "; or")) else more  # after the values: one more
    if argument.recipe:
        said += f" (null: the recipe's choice, else {plain(argument.unset) if default is None else _yaml(default)})"
    elif default is None and argument.unset:
        said += f" (null: {plain(argument.unset)})"
    return short_meaning(argument.doc) + said


def yaml_text(config: type = PipelineConfig) -> str:
    """``lightning_pipe/conf/strategy/pipeline.yaml``: every command-line argument with its default and its values."""
    lines = [YAML_HEADER.rstrip("\n")]
    for a in arguments(config):
        if a.cli:
            value = None if a.recipe else a.default
            lines.append(f"{a.name}: {_yaml(value)}  # {yaml_comment(a)}")
    return "\n".join(lines) + "\n"


def with_table(page: str, table: str) -> str:
    """``page`` with its arguments table replaced by ``table``."""
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + table + page[end:]


def flat_reads(config: type = PipelineConfig) -> str:
    """:class:`~lightning_pipe.config.PipelineConfig`'s properties that read each argument through its group
    (``config.schedule`` is ``config.steps.schedule``), each with its field's type, so that the type checker
    checks every read of a run's settings."""
    groups = argument_groups(config)
    lines = [FLAT_BEGIN]
    for name, annotation in group_fields(config):
        lines.append(
            f"    @property\n    def {name}(self) -> {annotation}:\n        return self.{groups[name]}.{name}\n\n"
        )
    return "".join(lines) + FLAT_END


def with_flat_reads(source: str, config: type = PipelineConfig) -> str:
    """``lightning_pipe/config.py`` with its flat reads replaced by :func:`flat_reads`."""
    start, end = source.index(FLAT_BEGIN), source.index(FLAT_END) + len(FLAT_END)
    return source[:start] + flat_reads(config) + source[end:]


ARGUMENTS_HEADER = '''"""Every keyword of ``PipelineStrategy``, typed, so that editors complete them and type checkers
check them (``PipelineStrategy(**arguments: Unpack[PipelineArguments])``). Written by
``python -m lightning_pipe.config_files`` from :mod:`lightning_pipe.config`'s fields and ``ProcessStrategy``'s
signature: change those, not this file. Their defaults and meanings: :class:`~lightning_pipe.config.PipelineConfig`,
or ``help(PipelineStrategy)``."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TypedDict

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_pipe.config import (
    Correction,
    DataParallelMode,
    PlanMode,
    Predictor,
    ReplicasSyncMode,
    ScheduleName,
    StartMethod,
)
from lightning_pipe.partition.stages.split import BalanceSpec
from lightning_pipe.runtime.activations.policy import OffloadSpec, RecomputeSpec
from lightning_pipe.runtime.loss_weights import LossWeight
from lightning_pipe.weights.names import Rename


class PipelineArguments(TypedDict, total=False):
    """``PipelineStrategy``'s keywords: the pipeline's arguments by their flat names, then the processes'."""

'''


def arguments_module(config: type = PipelineConfig, process: Callable[..., Any] | None = None) -> str:
    """:mod:`lightning_pipe.arguments`: the TypedDict of every ``PipelineStrategy`` keyword."""
    if process is None:
        from lightning_pipe.trainer.launch.processes import ProcessStrategy

        process = ProcessStrategy.__init__
    fields = dict(group_fields(config, internal=False, keyword=True))
    lines = [f"    {name}: {annotation}\n" for name, annotation in fields.items()]
    for name, parameter in inspect.signature(process).parameters.items():
        if name != "self":
            lines.append(f"    {name}: {parameter.annotation}\n")
    lines += [f"    {old}: {fields[new]}  # deprecated: {new}\n" for old, new in DEPRECATED.items()]
    return ARGUMENTS_HEADER + "".join(lines)


def written(config: type = PipelineConfig, root: Path = ROOT) -> Iterable[tuple[Path, str, str]]:
    """(file, what it holds, what it should hold) for the YAML, the docs page, the config's flat reads and the
    strategy's typed keywords."""
    yield root / YAML, (root / YAML).read_text(), yaml_text(config)
    page = (root / DOCS).read_text()
    yield root / DOCS, page, with_table(page, docs_table(config))
    source = (root / CONFIG).read_text()
    yield root / CONFIG, source, with_flat_reads(source, config)
    held = (root / ARGUMENTS).read_text() if (root / ARGUMENTS).exists() else ""
    yield root / ARGUMENTS, held, arguments_module(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail where a file differs instead of writing it")
    check = parser.parse_args(argv).check
    stale = [path for path, now, then in written() if now != then]
    if check:
        for path in stale:
            print(f"{path}: not as lightning_pipe/config.py says; run python -m lightning_pipe.config_files")
        return 1 if stale else 0
    for path, now, then in written():
        if now != then:
            path.write_text(then)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
