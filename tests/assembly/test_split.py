"""``pipeline_options``: the run's arguments resolved for this rank's placement (the settling itself is
``tests/test_resolve.py``'s)."""

from __future__ import annotations

import torch

from lightning_pipe.assembly.split import pipeline_options
from lightning_pipe.config import PipelineConfig
from lightning_pipe.resolve import resolve
from lightning_pipe.runtime.topology import Layout, Placement


def _placement(stages: int, replicas: int = 1) -> Placement:
    return Placement(Layout(stages, replicas), 0, tuple(range(stages)), torch.device("cpu"), "gloo")


def test_the_options_are_resolved_for_the_placements_layout() -> None:
    config = PipelineConfig(schedule="interleaved_1f1b", chunks=4, data_parallel="shard")
    options = pipeline_options(config, _placement(2, replicas=2))
    assert options == resolve(config, Layout(2, 2))
    assert (options.num_microbatches, options.virtual_stages, options.sharded) == (4, 2, True)
