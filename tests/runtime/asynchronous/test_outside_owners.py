"""The stage using each parameter every stage holds, under PipeMare's per-stage step sizes, and
each stage's own entries of those parameters in a checkpoint."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.runtime.asynchronous.outside_owners import owners_from_flags, qualify, unqualify


def test_each_parameter_is_owned_by_the_one_stage_that_gives_it_a_gradient() -> None:
    flags = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])  # stage 0 uses "a", stage 1 "c"; "b" unused
    assert owners_from_flags(flags, ["a", "b", "c"], [None, None, None]) == [0, None, 1]
    later = torch.zeros(2, 3)  # a step without gradients keeps what was found
    assert owners_from_flags(later, ["a", "b", "c"], [0, None, 1]) == [0, None, 1]


def test_a_parameter_two_stages_use_is_refused_naming_it_and_them() -> None:
    with pytest.raises(
        RuntimeError, match=r"'wpe' outside the split layers gets gradients on pipeline stages \[0, 1\]"
    ):
        owners_from_flags(torch.tensor([[1.0], [1.0]]), ["wpe"], [None])
    with pytest.raises(RuntimeError, match=r"stages \[0, 1\].*pipemare_warmup=0"):
        owners_from_flags(torch.tensor([[0.0], [1.0]]), ["wpe"], [0])  # one stage before, another now


def test_each_stage_saves_and_finds_its_own_entry_of_a_parameter_every_stage_holds() -> None:
    saved = {**qualify({"norm": 1, "0.w": 2}, {"norm"}, 0), **qualify({"norm": 3, "5.w": 4}, {"norm"}, 1)}
    assert saved == {"norm@stage0": 1, "0.w": 2, "norm@stage1": 3, "5.w": 4}
    assert unqualify(saved, {"norm", "0.w"}, {"norm"}, 0) == {"norm": 1, "0.w": 2}
    assert unqualify(saved, {"norm", "5.w"}, {"norm"}, 1) == {"norm": 3, "5.w": 4}
