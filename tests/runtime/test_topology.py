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


def test_a_placed_layout_puts_each_slot_on_the_rank_its_order_names() -> None:
    """Ranks 0 and 2 hold stage 0 (its replicas 0 and 1), ranks 1 and 3 stage 1."""
    layout = Layout(2, 2).placed([0, 2, 1, 3])
    assert layout.is_placed and layout.ranks() == [0, 2, 1, 3]
    assert [layout.stage_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert [layout.replica_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert layout.replica_ranks(0) == [0, 2] and layout.pipeline_ranks(1) == [2, 3]
    assert all(layout.rank(layout.stage_of(r), layout.replica_of(r)) == r for r in range(4))
    # one pipeline, its first stage on rank 1
    one = Layout(2, 1).placed((1, 0))
    assert one.pipeline_ranks(0) == [1, 0] and one.stage_of(0) == 1


def test_the_identity_order_is_the_default_layout() -> None:
    assert Layout(2, 2).placed([0, 1, 2, 3]) == Layout(2, 2)
    assert not Layout(2, 2).placed(None).is_placed
    assert Layout(2, 2, (0, 2, 1, 3)) == Layout(2, 2).placed([0, 2, 1, 3]) != Layout(2, 2)


def test_an_order_that_is_not_every_rank_once_is_refused() -> None:
    for bad in ([0, 1, 2], [0, 1, 1, 3], [1, 2, 3, 4]):
        with pytest.raises(ValueError, match="names each global rank 0..3 once"):
            Layout(2, 2).placed(bad)
