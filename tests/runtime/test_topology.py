"""The stages x replicas arithmetic, without processes."""

from __future__ import annotations

import pytest

from lightning_pipe.runtime.topology import Layout


def test_replicas_of_a_stage_are_neighbouring_ranks() -> None:
    layout = Layout.of(8, 2)
    assert (layout.stages, layout.replicas) == (2, 4)
    assert layout.replica_ranks(0) == [0, 1, 2, 3]
    assert layout.pipeline_ranks(1) == [1, 5]
    assert [layout.stage_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.replica_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert all(layout.rank(layout.stage_of(r), layout.replica_of(r)) == r for r in range(8))


def test_no_stages_means_one_pipeline_over_the_world() -> None:
    assert Layout.of(4, None) == Layout(4, 1)
    assert Layout.of(4, 1) == Layout(1, 4)


def test_a_world_that_stages_does_not_divide_names_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"stages=3\) does not divide the world size 8"):
        Layout.of(8, 3)
