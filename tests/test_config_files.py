"""Each strategy argument is defined once, in ``PipelineConfig``: the command line's strategy files and the
arguments table of docs/usage.md name the same arguments with the same defaults."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_pipe.cli import CONFIG_DIR, STRATEGY_KEYS, build_strategy, check_keys
from lightning_pipe.config import PipelineConfig
from lightning_pipe.strategy import PipelineStrategy
from tests.test_cli import _compose

ROOT = Path(__file__).resolve().parents[1]
STRATEGY_DIR = Path(CONFIG_DIR) / "strategy"
BASE = STRATEGY_DIR / "pipeline.yaml"
DEFAULTS = {f.name: f.default for f in dataclasses.fields(PipelineConfig)}
# null in the base file where PipelineConfig's default is a value that the command line computes
COMPUTED = {
    "recompute": "PipelineStrategy's recompute=None is 'never'; null lets checkpoint=, its former name, be given alone",
    "balance": "the recipe's strategy_defaults (balance='parameters'), else PipelineConfig's 'uniform'",
}
SCHEDULE_FILES = sorted(p.stem for p in STRATEGY_DIR.glob("*.yaml") if p.stem not in ("pipeline", "none"))
# PipelineConfig's fields that are no PipelineStrategy argument: `lightning-pipe plan` sets it
NOT_ARGUMENTS = {"plan_all_layouts"}


def _yaml(path: Path) -> dict[str, Any]:
    value = OmegaConf.to_container(OmegaConf.load(path))
    assert isinstance(value, dict)
    return value


def test_the_base_file_holds_every_argument_once_with_pipeline_configs_default() -> None:
    base = _yaml(BASE)
    assert set(base) == {"name", *STRATEGY_KEYS}  # every argument the command line takes, and nothing else
    assert set(STRATEGY_KEYS) - {"checkpoint"} <= set(DEFAULTS)
    assert base.pop("name") == "pipeline" and base.pop("checkpoint") is None  # the deprecated name of recompute
    for key, value in base.items():
        expected = None if key in COMPUTED else DEFAULTS[key]
        assert value == expected, f"conf/strategy/pipeline.yaml: {key}: {value!r}, PipelineConfig: {DEFAULTS[key]!r}"
    # as the command line reads it, without a recipe's choices: PipelineStrategy()'s own configuration
    strategy, _ = build_strategy(_compose(["strategy=pipeline"]).strategy, 2)
    assert strategy.config == PipelineConfig()


@pytest.mark.parametrize("option", SCHEDULE_FILES)
def test_each_schedule_file_composes_to_arguments_the_strategy_accepts(option: str) -> None:
    own = _yaml(STRATEGY_DIR / f"{option}.yaml")
    assert own.pop("defaults") == ["pipeline", "_self_"]  # the base file first, then what differs
    assert own["schedule"] == option and set(own) <= set(STRATEGY_KEYS)
    cfg = _compose([f"strategy={option}"])
    assert set(cfg.strategy) == set(_yaml(BASE))  # every argument, from the base file
    check_keys(cfg)
    strategy, _ = build_strategy(cfg.strategy, 2)
    config = strategy.config
    assert {key: getattr(config, key) for key in own} == own
    for key, value in _yaml(BASE).items():
        if key not in own and key not in ("name", "checkpoint", *COMPUTED):
            assert getattr(config, key) == (
                value if value is not None else getattr(PipelineConfig(schedule=option), key)
            )


@pytest.mark.parametrize("recipe", ["bert_mlm", "vgg19_cifar100", "llama"])
def test_the_recipes_choose_balance_by_parameters_unless_the_run_sets_it(recipe: str) -> None:
    """The recipes' layers differ in size: each recipe asks for ``balance='parameters'`` (as the llama
    recipe asks for its ``module``); the default run splits BERT as before, 4 micro-batches on 2 stages."""
    if recipe == "llama" and importlib.util.find_spec("transformers") is None:
        pytest.skip("recipe=llama needs transformers (the hf extra)")
    small = ["recipe.model.width=0.125"] if recipe == "vgg19_cifar100" else []
    cfg = _compose([f"recipe={recipe}", *small])
    model = instantiate(cfg.recipe.model)
    config = build_strategy(cfg.strategy, cfg.trainer.devices, model.strategy_defaults)[0].config
    assert (config.balance, config.num_microbatches(2)) == ("parameters", 4)
    given = _compose([f"recipe={recipe}", "strategy.balance=uniform", *small]).strategy
    assert build_strategy(given, 2, model.strategy_defaults)[0].config.balance == "uniform"


def _arguments_table() -> dict[str, str]:
    """docs/usage.md's arguments table: each row's argument and its values cell."""
    lines = (ROOT / "docs" / "usage.md").read_text().splitlines()
    start = lines.index("| argument | values | meaning |")
    table = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        name, values = (cell.strip() for cell in line.strip("|").split(" | ")[:2])
        match = re.match(r"`(\w+)`", name)
        assert match, line
        table[match.group(1)] = values
    return table


def test_the_arguments_table_lists_every_argument_with_pipeline_configs_default() -> None:
    table = _arguments_table()
    arguments = [
        p.name
        for p in inspect.signature(PipelineStrategy.__init__).parameters.values()
        if p.name not in ("self", "checkpoint") and p.kind is not inspect.Parameter.VAR_KEYWORD
    ]  # checkpoint: in recompute's row, as its former name
    assert sorted(table) == sorted(arguments) == sorted(set(DEFAULTS) - NOT_ARGUMENTS)
    for name, values in table.items():
        # `"never"` (default) or (default `None`: what it becomes)
        stated = re.findall(r"`([^`]+)` \(default[):]", values) + re.findall(r"\(default `([^`]+)`", values)
        assert len(stated) == 1, f"docs/usage.md, {name}: state the default once, as `value` (default): {values}"
        assert ast.literal_eval(stated[0]) == DEFAULTS[name], f"docs/usage.md, {name}: {stated[0]}"
