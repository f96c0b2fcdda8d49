"""``PipelineStrategy``'s typed keywords (:mod:`lightning_pipe.arguments`) and the enumerations' ``Literal``
types: they name every argument and every allowed value, as the fields that check them do. The type checker's
side is tests/static/strategy_arguments.py, which CI's mypy checks."""

from __future__ import annotations

import inspect
import typing

from lightning_pipe.arguments import PipelineArguments
from lightning_pipe.command_keys import DEPRECATED
from lightning_pipe.config import PipelineConfig, arguments
from lightning_pipe.schedules import TRAITS, ScheduleName
from lightning_pipe.strategy import PipelineStrategy
from lightning_pipe.trainer.launch.processes import ProcessStrategy


def _literals(annotation: object) -> set[object]:
    """The values of the ``Literal`` types inside ``annotation`` (a union, an alias)."""
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    return {v for arg in typing.get_args(annotation) for v in _literals(arg)}


def test_the_typed_keywords_are_every_argument_the_strategy_takes() -> None:
    process = [p for p in inspect.signature(ProcessStrategy.__init__).parameters if p != "self"]
    assert list(PipelineArguments.__annotations__) == [a.name for a in arguments()] + process + list(DEPRECATED)
    assert PipelineArguments.__total__ is False  # every keyword may be left out
    assert PipelineStrategy.__init__.__annotations__["arguments"] == "Unpack[PipelineArguments]"


def test_every_enumeration_is_a_literal_of_exactly_the_values_its_field_accepts() -> None:
    hints = typing.get_type_hints(PipelineArguments)
    enumerations = 0
    for a in arguments():
        literal = _literals(hints[a.name])
        if not literal:
            continue
        enumerations += 1
        allowed = {v for v in a.values if isinstance(v, str)} if not isinstance(a.values, str) else set()
        assert literal == allowed, (a.name, literal, allowed)
    assert enumerations >= 8  # schedule, balance, recompute, plan, data_parallel, replicas_sync, ...


def test_the_schedule_literal_names_the_traits_table() -> None:
    assert typing.get_args(ScheduleName) == tuple(TRAITS)


def test_every_flat_read_is_a_property_that_reads_its_group() -> None:
    config = PipelineConfig(schedule="gpipe", chunks=3, data_parallel="shard", stages=2)
    for a in arguments(internal=True):
        assert isinstance(inspect.getattr_static(PipelineConfig, a.name), property), a.name
        assert getattr(config, a.name) is getattr(getattr(config, a.group), a.name), a.name
    assert (config.schedule, config.chunks, config.data_parallel) == ("gpipe", 3, "shard")
