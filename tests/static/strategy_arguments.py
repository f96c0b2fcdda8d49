"""Checked by mypy (``pyproject.toml``'s ``[tool.mypy] files``), never run: ``PipelineStrategy``'s keywords as a
user's editor and type checker see them. Each ``type: ignore[code]`` is an error the type checker must report;
``warn_unused_ignores`` fails the check where it no longer does (an argument typed ``Any`` again)."""

from __future__ import annotations

from lightning_pipe import PipelineStrategy
from lightning_pipe.config import PipelineConfig


def written_right() -> PipelineStrategy:
    return PipelineStrategy(schedule="zbv", chunks=8, data_parallel="shard", stages=2, recompute=["never", "always"])


def misspelt() -> PipelineStrategy:
    return PipelineStrategy(chunk=8)  # type: ignore[call-arg]


def a_string_for_an_int() -> PipelineStrategy:
    return PipelineStrategy(chunks="8")  # type: ignore[arg-type]


def an_unknown_mode() -> PipelineStrategy:
    return PipelineStrategy(data_parallel="zero3")  # type: ignore[arg-type]


def a_read_typed(config: PipelineConfig) -> int:  # chunks is int | None
    return config.chunks  # type: ignore[return-value]


def a_read_that_does_not_exist(config: PipelineConfig) -> object:
    return config.chunk  # type: ignore[attr-defined]


def your_own_schedule() -> PipelineStrategy:
    return PipelineStrategy(schedule_text="mine.csv", chunks=4)


def your_own_schedule_in_the_names_field() -> PipelineStrategy:
    return PipelineStrategy(schedule="mine.csv")  # type: ignore[arg-type]
