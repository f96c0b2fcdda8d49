"""``pipeline_options``: the run's arguments as the values the pipeline runs by, every default that
depends on the schedule or the layout resolved once."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.assembly.split import pipeline_options
from lightning_pipe.config import PipelineConfig
from lightning_pipe.runtime.asynchronous.pipemare import DEFAULT_WARMUP
from lightning_pipe.runtime.options import PipelineOptions
from lightning_pipe.runtime.topology import Layout, Placement


def _placement(stages: int, replicas: int = 1) -> Placement:
    return Placement(Layout(stages, replicas), 0, tuple(range(stages)), torch.device("cpu"), "gloo")


def test_the_defaults_are_resolved_for_the_layout() -> None:
    options = pipeline_options(PipelineConfig(), _placement(3))
    assert options == PipelineOptions(
        schedule="1f1b",
        num_microbatches=6,
        virtual_stages=1,
        recompute=("never",) * 3,  # one per pipeline stage
        offload=(None,) * 3,
        gradient_accumulation_fusion=True,
    )
    interleaved = pipeline_options(PipelineConfig(schedule="interleaved_1f1b", chunks=4), _placement(2))
    assert (interleaved.num_microbatches, interleaved.virtual_stages) == (4, 2)


@pytest.mark.parametrize(
    "arguments, warmup, correction",
    [
        ({"schedule": "pipemare"}, DEFAULT_WARMUP, True),  # both on by default
        ({"schedule": "pipemare", "pipemare_correction": False, "pipemare_warmup": 0}, 0, False),
        ({"schedule": "pipedream"}, 0, False),  # off by default
        ({"schedule": "pipedream_2bw", "pipemare_warmup": 50}, 50, False),
    ],
)
def test_pipemare_switches_are_resolved_per_schedule(arguments: dict, warmup: int, correction: bool) -> None:
    options = pipeline_options(PipelineConfig(**arguments), _placement(2))
    assert (options.pipemare_warmup, options.pipemare_correction) == (warmup, correction)


def test_shard_holds_only_where_there_are_replicas() -> None:
    config = PipelineConfig(data_parallel="shard", recompute="always", gradient_accumulation_fusion=False)
    assert pipeline_options(config, _placement(2, replicas=2)).sharded
    alone = pipeline_options(config, _placement(2))
    assert not alone.sharded and alone.recompute == ("always", "always") and not alone.gradient_accumulation_fusion
