"""Chimera's two copies of each stage, without processes: the split, the ties, what a copy's
gradient counts, where losses are computed, and what a checkpoint skips."""

from __future__ import annotations

from torch import nn

from lightning_pipe.partition.stages.virtual import split_stages, ties_by_position
from lightning_pipe.runtime.grads.copies import loss_ranks, reaching, renamed_ties, written_elsewhere
from lightning_pipe.schedules import chimera, one_f_one_b, stage_positions


def _layers() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(3, 3) for _ in range(6)])


def test_each_process_holds_its_stage_and_the_up_copy_of_the_mirror_stage() -> None:
    layers, balance = _layers(), [1, 2, 2, 1]
    positions = stage_positions("chimera", 4, 1)
    assert positions == [0, 1, 2, 3, 3, 2, 1, 0]
    host, stages = split_stages(layers, balance, positions, 1)
    assert sorted(stages) == [1, 6]
    assert list(stages[1]._modules) == ["1", "2"] and list(stages[6]._modules) == ["3", "4"]
    assert (stages[1].stage, stages[6].stage, stages[6].num_stages) == (1, 2, 4)  # the copy runs as stage 2
    assert list(host._modules) == ["1", "2", "3", "4"]
    mirror, _ = split_stages(layers, balance, positions, 2)
    assert list(mirror._modules) == list(host._modules)  # the pair holds the same layers
    assert stages[1][1] is layers[1] and stages[6][3] is layers[3]  # the unsplit Sequential's positions


def test_ties_span_every_process_holding_a_copy() -> None:
    positions = stage_positions("chimera", 4, 1)
    # the first and last stage tied: processes 0 and 3 each hold both, under the first layer's name
    assert ties_by_position([{0: "0.weight", 3: "5.weight"}], positions, 4) == [{0: "0.weight", 3: "0.weight"}]
    # stages 0 and 1 tied: four processes hold one of them
    tie = ties_by_position([{0: "0.weight", 1: "1.weight"}], positions, 4)
    assert tie == [{0: "0.weight", 1: "1.weight", 3: "0.weight", 2: "1.weight"}]
    # without copies, as before: keyed by position, the first stage's first
    assert ties_by_position([{1: "a", 2: "b"}], [0, 1, 0, 1]) == [{1: "a", 0: "b"}]


def test_a_copy_counts_its_own_pipelines_microbatches() -> None:
    layers, balance = _layers(), [1, 2, 2, 1]
    _, stages = split_stages(layers, balance, stage_positions("chimera", 4, 1), 0)
    counts = reaching(chimera(4, 6), stages)  # units of 4: 0, 1 down, 2, 3 up; then 4 down, 5 up
    assert counts[id(layers[0].weight)] == 3 and counts[id(layers[5].weight)] == 3
    counts = reaching(chimera(4, 5), stages)
    assert counts[id(layers[0].weight)] == 3 and counts[id(layers[5].weight)] == 2


def test_losses_of_both_pipelines_and_the_rank_that_shares_them() -> None:
    assert loss_ranks(chimera(4, 4), [10, 11, 12, 13]) == [13, 10]  # down ends on the last, up on the first
    assert loss_ranks(one_f_one_b(4, 4), [0, 1, 2, 3]) == [3]


def test_checkpoint_names_written_by_the_other_process() -> None:
    layers, balance = _layers(), [1, 2, 2, 1]
    positions = stage_positions("chimera", 4, 1)
    _, stages = split_stages(layers, balance, positions, 0)
    assert written_elsewhere(stages, 4, "layers.") == {"layers.5.weight", "layers.5.bias"}
    _, stages = split_stages(layers, balance, positions, 3)
    assert written_elsewhere(stages, 4, "layers.") == {"layers.0.weight", "layers.0.bias"}
    _, single = split_stages(layers, [3, 3], [0, 1], 0)
    assert written_elsewhere(single, 2, "layers.") == frozenset()


def test_a_tied_weight_is_written_under_the_name_of_the_stage_that_writes_it() -> None:
    layers = _layers()
    layers[5].weight = layers[0].weight  # tied first and last layer
    positions = stage_positions("chimera", 4, 1)
    host, stages = split_stages(layers, [1, 2, 2, 1], positions, 3)  # stage 3 and the up copy of stage 0
    skip = written_elsewhere(stages, 4, "layers.")
    assert "layers.0.weight" in skip and "layers.5.weight" not in skip
    assert renamed_ties(host, skip, "layers.") == {"layers.0.weight": "layers.5.weight"}
    host, stages = split_stages(layers, [1, 2, 2, 1], positions, 0)  # stage 0 writes its own name
    assert renamed_ties(host, written_elsewhere(stages, 4, "layers."), "layers.") == {}
