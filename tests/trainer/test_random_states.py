"""Each rank's random state in a checkpoint: restored under the same layout, re-seeded (with one
warning) under another (the exact resume of a 2-stage run with dropout is in
tests/trainer/dataloaders/test_resume.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lightning_pipe.assembly.split import layout_key
from lightning_pipe.runtime.topology import Layout
from lightning_pipe.trainer.random_states import KEY, ResumedRandom, collect, gathered


def _draws() -> tuple[torch.Tensor, float, float]:
    return torch.rand(3), random.random(), float(np.random.rand())


def test_a_saved_state_comes_back_where_the_run_continues_and_another_layout_is_reseeded() -> None:
    key = layout_key(Layout(2, 1), [4, 4])
    saved = gathered(key)  # one process: its own state
    expected = _draws()
    _draws()
    resumed = ResumedRandom()
    checkpoint = {KEY: saved, "global_step": 3}
    assert resumed.take(checkpoint, key, 0) is checkpoint and KEY not in checkpoint  # Lightning never sees it
    resumed.at_data(mid_epoch=True)  # saved within an epoch: not yet
    assert not torch.equal(_draws()[0], expected[0])
    resumed.at_step()
    again = _draws()
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]
    resumed.at_step()  # once only
    assert not torch.equal(_draws()[0], expected[0])

    moved = layout_key(Layout(1, 2), [8])  # another layout: the saved states are other stages'
    firsts = []
    for _ in range(2):
        with pytest.warns(UserWarning, match="model randomness \\(dropout\\) is not restored exactly"):
            resumed.take({KEY: gathered(key), "global_step": 3}, moved, 1)
        resumed.at_data(mid_epoch=False)  # at an epoch's end: before the DataLoader's first iterator
        firsts.append(_draws())
    assert torch.equal(firsts[0][0], firsts[1][0]) and firsts[0][1:] == firsts[1][1:]  # deterministic
    assert "numpy" in collect() and collect()["numpy"][1].dtype == torch.int64  # readable with weights_only
