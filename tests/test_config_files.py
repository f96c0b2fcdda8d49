"""Each strategy argument is defined once, in ``PipelineConfig``'s fields: the signature, the command line's keys,
its strategy files and the arguments table of docs/usage.md come from them."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_pipe import config_files
from lightning_pipe.cli import CONFIG_DIR, STRATEGY_KEYS, build_strategy, check_keys
from lightning_pipe.config import PipelineConfig, arguments, cli_keys, option, split_arguments, strategy_signature
from lightning_pipe.schedules import TRAITS
from lightning_pipe.strategy import PipelineStrategy
from lightning_pipe.trainer.launch.processes import ProcessStrategy
from tests.test_cli import _compose

STRATEGY_DIR = Path(CONFIG_DIR) / "strategy"
BASE = STRATEGY_DIR / "pipeline.yaml"
DEFAULTS = {a.name: a.default for a in arguments()}
# null in the base file: the recipe's choice (its strategy_defaults), else PipelineConfig's default
RECIPE = {a.name for a in arguments() if a.recipe}
SCHEDULE_FILES = sorted(p.stem for p in STRATEGY_DIR.glob("*.yaml") if p.stem not in ("pipeline", "none"))


def _yaml(path: Path) -> dict[str, Any]:
    value = OmegaConf.to_container(OmegaConf.load(path))
    assert isinstance(value, dict)
    return value


def test_the_yaml_and_the_docs_table_are_as_the_config_writes_them() -> None:
    for path, now, then in config_files.written():
        assert now == then, f"{path}: run python -m lightning_pipe.config_files"
    assert config_files.main(["--check"]) == 0
    assert sorted(TRAITS) == SCHEDULE_FILES  # a strategy file per schedule
    comment = BASE.read_text().split("\nschedule: ", 1)[1].split("\n", 1)[0]
    assert all(f" {name} |" in comment for name in TRAITS), comment  # dualpipev, xpipe and wpipe too


def test_the_base_file_holds_every_argument_once_with_pipeline_configs_default() -> None:
    base = _yaml(BASE)
    assert set(base) == {"name", *STRATEGY_KEYS}  # every argument the command line takes, and nothing else
    assert set(STRATEGY_KEYS) == set(DEFAULTS) - {"init", "rename"}  # the callables: Python only
    assert base.pop("name") == "pipeline"
    for key, value in base.items():
        expected = None if key in RECIPE else DEFAULTS[key]
        assert value == expected, f"conf/strategy/pipeline.yaml: {key}: {value!r}, PipelineConfig: {DEFAULTS[key]!r}"
    # as the command line reads it, without a recipe's choices: PipelineStrategy()'s own configuration
    strategy, _ = build_strategy(_compose(["strategy=pipeline"]).strategy, 2)
    assert strategy.config == PipelineConfig()


def test_the_signature_shows_every_argument_with_its_default_and_refuses_others() -> None:
    parameters = inspect.signature(PipelineStrategy).parameters
    assert {name: parameters[name].default for name in DEFAULTS} == DEFAULTS
    assert list(parameters)[: len(DEFAULTS)] == list(DEFAULTS)  # then ProcessStrategy's: accelerator, timeout, ...
    assert {"accelerator", "timeout"} <= set(parameters) and "checkpoint" not in parameters  # the former name
    assert next(iter(inspect.signature(PipelineStrategy.__init__).parameters)) == "self"
    assert "plan_all_layouts" not in parameters  # `lightning-pipe plan`'s switch, no argument
    with pytest.raises(TypeError, match=r"'chunk' \(did you mean 'chunks'\?\)"):
        PipelineStrategy(chunk=4)
    with pytest.raises(TypeError, match="'plan_all_layouts'"):
        PipelineStrategy(plan_all_layouts=True)
    strategy = PipelineStrategy(schedule="gpipe", chunks=4, stages=2, timeout=None)
    assert (strategy.config.steps.schedule, strategy.config.chunks, strategy.config.layout.stages) == ("gpipe", 4, 2)


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """A group that a later version might add."""

    warmup_batches: int = option(0, values="int >= 0")
    """batches to run before the first step that counts."""

    def check(self) -> None:
        if self.warmup_batches < 0:
            raise ValueError(f"warmup_batches={self.warmup_batches}: give 0 or more.")

    def __post_init__(self) -> None:
        self.check()


@dataclasses.dataclass(frozen=True, init=False)
class ConfigWithWarmup(PipelineConfig):
    warmup: WarmupConfig = dataclasses.field(default_factory=WarmupConfig)


def test_an_argument_added_to_the_config_appears_everywhere_it_is_shown() -> None:
    """One field, written once, is an argument of the signature, a key of the command line and of its YAML,
    a row of the docs table, and routed to its group by name."""
    signature = strategy_signature(ProcessStrategy.__init__, ConfigWithWarmup)
    assert signature.parameters["warmup_batches"].default == 0
    assert signature.parameters["warmup_batches"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "warmup_batches" in cli_keys(ConfigWithWarmup) and "warmup_batches" not in cli_keys()
    yaml = OmegaConf.create(config_files.yaml_text(ConfigWithWarmup))
    assert yaml.warmup_batches == 0 and "# batches to run before the first step that counts: int >= 0" in (
        config_files.yaml_text(ConfigWithWarmup)
    )
    assert (
        "| `warmup_batches` | int >= 0 (default `0`) | batches to run before the first step that counts. |"
        in config_files.docs_table(ConfigWithWarmup).splitlines()
    )
    config, processes = split_arguments(
        {"warmup_batches": 3, "chunks": 2, "timeout": None}, ["timeout"], ConfigWithWarmup
    )
    assert (config.warmup.warmup_batches, config.warmup_batches, config.chunks, processes) == (
        3,
        3,
        2,
        {"timeout": None},
    )
    assert config.replace(warmup_batches=5).warmup_batches == 5 and config.warmup_batches == 3
    with pytest.raises(ValueError, match="warmup_batches=-1"):
        ConfigWithWarmup(warmup_batches=-1)
    with pytest.raises(TypeError, match="did you mean 'warmup_batches'"):
        ConfigWithWarmup(warmup_batch=1)


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
        if key not in own and key not in ("name", *RECIPE):
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
