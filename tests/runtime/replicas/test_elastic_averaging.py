"""The pure parts of elastic averaging: the coefficient for a layout, and a checkpoint's per-stage
states read back as one."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.checkpoint.merged import merged_elastic_state
from lightning_pipe.runtime.replicas.elastic_averaging import elastic_alpha


def test_the_default_coefficient_moves_the_center_nine_tenths_to_the_replicas_mean() -> None:
    assert elastic_alpha(2, None) == pytest.approx(0.45)
    assert elastic_alpha(3, None) == pytest.approx(0.3)
    assert elastic_alpha(4, 0.25) == 0.25  # replicas x alpha = 1: the center jumps to the mean
    with pytest.raises(ValueError, match="has 1 replica"):
        elastic_alpha(1, None)  # nothing to average


def test_a_checkpoint_gives_the_center_of_every_stage_and_each_stage_its_own_entry() -> None:
    def shard(stage: int, name: str) -> dict:
        state = {"stage": stage, "stages": 2, "replicas": 2, "steps": 3, "center": {name: torch.ones(2)}, "own": []}
        return {"extra": {"elastic": state}}

    merged = merged_elastic_state([shard(0, "layers.0.weight"), shard(1, "layers.5.weight")])
    assert merged is not None
    state = merged["elastic"]
    assert state["steps"] == 3 and set(state["center"]) == {"layers.0.weight", "layers.5.weight"}
    assert sorted(state["stages"]) == [0, 1] and state["stages"][1]["center"].keys() == {"layers.5.weight"}
    assert merged_elastic_state([shard(0, "a"), {"extra": None}]) is None  # a checkpoint without it
