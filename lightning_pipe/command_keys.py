"""The command line's keys, checked before torch and Lightning are imported, so that a misspelt key
(``strategy.chunk=4``) is answered at once, naming the close key, instead of after seconds of imports.

The keys come from files, not from imported code: the strategy's from ``conf/strategy/*.yaml`` (written from
``config.py``'s fields and checked against them by the tests), the Trainer's from the signature in Lightning's
source, read without importing it."""

from __future__ import annotations

import ast
import difflib
import importlib.util
from collections.abc import Sequence
from functools import cache
from importlib.resources import files
from pathlib import Path

#: former strategy arguments and their names now (``PipelineConfig`` takes them with a warning)
DEPRECATED = {"checkpoint": "recompute"}
#: top-level keys that are not in config.yaml: what `lightning-pipe plan` adds
INTERNAL_KEYS = ("plan_only",)
#: Trainer arguments the command line sets itself, and how to set them instead
SET_BY_THE_COMMAND = {
    "strategy": "choose it with strategy=<option> and strategy.<key>=<value>",
    "logger": "choose it with logger=csv or logger=tensorboard",
    "callbacks": "the command line adds its own; use the Python API for others",
    "default_root_dir": "each run writes to its Hydra folder: hydra.run.dir=PATH",
    "enable_checkpointing": "use checkpoint=true",
}


def config_dir() -> Path:
    """The command line's Hydra configuration, shipped inside the package."""
    return Path(str(files("lightning_pipe.conf"))).resolve()


@cache
def top_level_keys() -> tuple[str, ...]:
    """config.yaml's own keys and the groups."""
    from omegaconf import OmegaConf

    own = OmegaConf.load(config_dir() / "config.yaml")
    return (*[str(k) for k in own if k not in ("defaults", "hydra")], "recipe", "strategy", "trainer")


@cache
def strategy_keys() -> tuple[str, ...]:
    """Every ``strategy.<key>`` a strategy file holds (``pipeline.yaml`` holds every argument of the strategy)."""
    from omegaconf import OmegaConf

    in_files = {str(k) for f in (config_dir() / "strategy").glob("*.yaml") for k in OmegaConf.load(f)}
    return tuple(sorted(in_files - {"defaults", "name"}))  # defaults: Hydra's list, not a key


@cache
def trainer_keys() -> tuple[str, ...] | None:
    """The arguments of ``lightning.Trainer``, read from its source without importing Lightning; None where
    the source is not found (then the check after the imports looks)."""
    spec = importlib.util.find_spec("lightning")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "pytorch" / "trainer" / "trainer.py"
    if not source.is_file():
        return None
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "Trainer":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    arguments = [*item.args.args, *item.args.kwonlyargs]
                    return tuple(a.arg for a in arguments if a.arg != "self")
    return None


def hint(prefix: str, name: str, valid: Sequence[str]) -> str:
    """`` (did you mean <key>?)`` for an unknown key, naming only keys a user can write: a strategy or Trainer
    argument given at the top level (``plan=auto``) is sent to its node (``strategy.plan``), and otherwise the
    closest of ``valid`` (which holds no internal key such as the planner's ``plan_only``)."""
    if not prefix:
        if name in strategy_keys():
            return f" (did you mean strategy.{name}?)"
        if name in (trainer_keys() or ()) and name not in SET_BY_THE_COMMAND:
            return f" (did you mean trainer.{name}?)"
    if prefix == "strategy." and name in DEPRECATED:
        return f" (renamed: {prefix}{DEPRECATED[name]})"
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def check_overrides(args: Sequence[str]) -> None:
    """Refuse a misspelt key of the top level, ``strategy`` or ``trainer`` before Hydra sees it, naming the
    close key (``strategy.chunk=4``: did you mean strategy.chunks?). Hydra's own answer would suggest
    adding the misspelt key with ``+``."""
    problems = []
    for arg in args:
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue
        key = arg.split("=", 1)[0]
        head, _, rest = key.partition(".")
        if head == "hydra" or "/" in key or "." in rest:
            continue
        valid: Sequence[str] | None
        if not rest:
            if head in INTERNAL_KEYS:
                continue
            prefix, name, valid = "", head, top_level_keys()
        elif head == "strategy":
            prefix, name, valid = "strategy.", rest, ("name", *strategy_keys())
        elif head == "trainer":
            prefix, name, valid = "trainer.", rest, trainer_keys()
        else:
            continue
        if valid is not None and name not in valid:
            problems.append(
                f"unknown key {prefix}{name}{hint(prefix, name, valid)}. Valid keys: {', '.join(sorted(valid))}."
            )
    if problems:
        raise SystemExit("\n".join(f"lightning-pipe: {problem}" for problem in problems))
