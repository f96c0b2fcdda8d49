"""A stage's gradients between its backward and the optimizer step, on one process (a gloo world
of one: every sum over ranks is the rank's own value, so what is checked is the bookkeeping)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipe.runtime.grads.gradients import StageGradients, Tie, swap_grads, tie_groups
from lightning_pipe.runtime.topology import Layout, Topology


def _params(*shapes: tuple[int, ...]) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(*shape)) for shape in shapes]


def test_swapping_gives_each_parameter_its_replacement_and_returns_what_it_had() -> None:
    a, b = _params((2,), (3,))
    a.grad, b.grad = torch.ones(2), None
    replacement = {b: torch.full((3,), 2.0)}
    held = swap_grads([a, b], replacement)
    assert a.grad is None and torch.equal(b.grad, torch.full((3,), 2.0))
    assert torch.equal(held[a], torch.ones(2)) and held[b] is None


def test_kept_gradients_are_handed_over_scaled_and_added_after_a_zero_grad(world_of_one: Topology) -> None:
    params = _params((4, 3), (3,))
    gradients = StageGradients([], [], world_of_one.pp_group, 1, counts_shared=True, dp_group=world_of_one.dp_group)
    computed = [torch.randn(4, 3), torch.randn(3)]
    for p, g in zip(params, computed):
        p.grad = g.clone()
    gradients.take(params, {params[0]: torch.ones(4, 3)})  # the schedule's gradients aside; the saved ones back
    assert torch.equal(params[0].grad, torch.ones(4, 3)) and params[1].grad is None
    gradients.hand_over(0.5)  # averaged over the (one) replica on the way
    torch.testing.assert_close(params[0].grad, torch.ones(4, 3) + 0.5 * computed[0])
    torch.testing.assert_close(params[1].grad, 0.5 * computed[1])
    assert gradients.pending == {}


def test_replica_buckets_split_by_size_and_dtype(world_of_one: Topology) -> None:
    params = [*_params((8,), (8,)), nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    grads = [torch.arange(8.0), torch.arange(8.0) + 1, torch.arange(4.0, dtype=torch.float64)]
    for bucket_bytes, sizes in ((1000, [1, 2]), (32, [1, 1, 1])):  # backward order: the float64 one apart, then by size
        dp = world_of_one.dp_group
        gradients = StageGradients(
            [], [], world_of_one.pp_group, 1, counts_shared=True, dp_group=dp, bucket_bytes=bucket_bytes
        )
        gradients.keep(dict(zip(params, [g.clone() for g in grads])))
        assert [len(b.tensors) for b in gradients._buckets] == sizes
        for p in params:
            p.grad = None
        gradients.hand_over(1.0)
        for p, g in zip(params, grads):
            assert torch.equal(p.grad, g)


def test_parameters_outside_the_sequential_keep_no_gradient_where_no_stage_got_one(world_of_one: Topology) -> None:
    """Summed over the stages (here one): a stage whose piece of forward did not use one adds zeros,
    but one that no stage got a gradient for (frozen, or unused) keeps None, as in plain training,
    so the optimizer leaves it alone (weight decay included). The same for a tied weight."""
    inside, used, unused, tied, frozen_tie = _params((3,), (2, 2), (2,), (2,), (3,))
    ties = [Tie(world_of_one.pp_group, tied, True), Tie(world_of_one.pp_group, frozen_tie, True)]
    gradients = StageGradients([used, unused], ties, world_of_one.pp_group, 2, counts_shared=True)
    gradients.keep({inside: torch.ones(3), used: torch.full((2, 2), 2.0), unused: None, tied: torch.ones(2)})
    gradients.hand_over(1.0)
    assert torch.equal(inside.grad, torch.ones(3)) and torch.equal(used.grad, torch.full((2, 2), 2.0))
    assert torch.equal(tied.grad, torch.ones(2))
    assert unused.grad is None and frozen_tie.grad is None


def test_the_global_norm_counts_a_gradient_held_on_several_ranks_once(world_of_one: Topology) -> None:
    weight, shared, tied = _params((3, 3), (2,), (2,))
    for p in (weight, shared, tied):
        p.grad = torch.full_like(p, 2.0)
    expected = torch.sqrt(torch.tensor(9 * 4.0))  # the weight's alone: shared and tied counted by another stage
    ties = [Tie(world_of_one.pp_group, tied, False)]
    gradients = StageGradients(
        [shared], ties, world_of_one.pp_group, 2, counts_shared=False, norm_group=world_of_one.pp_group
    )
    norm = gradients.clip_grad_norm_([weight, shared, tied], 1.0, torch.device("cpu"))
    torch.testing.assert_close(norm, expected)
    coef = 1.0 / (expected + 1e-6)
    for p in (weight, shared, tied):  # every gradient is clipped, counted or not
        torch.testing.assert_close(p.grad, torch.full_like(p, 2.0) * coef)


def test_each_tie_gets_a_group_per_replica_and_the_lowest_stage_counts_it() -> None:
    asked: list[list[int]] = []

    def new_group(ranks: list[int]) -> str:
        asked.append(ranks)
        return f"group{ranks}"

    stage = nn.Sequential(nn.Linear(2, 2))
    ties = [{0: "0.weight", 3: "0.weight"}]
    layout = Layout(4, 2)
    named = dict(stage.named_parameters())
    found = tie_groups(ties, layout, stage=3, replica=1, local_params=named, new_group=new_group)
    assert asked == [[0, 6], [1, 7]]  # stage 0 and 3 of replica 0, then of replica 1
    assert found == [("group[1, 7]", stage[0].weight, False)]
    assert found[0] == Tie(group="group[1, 7]", param=stage[0].weight, counted=False)  # read by name
    assert tie_groups(ties, layout, 0, 0, named, new_group)[0][2] is True
    assert tie_groups(ties, layout, 0, 0, named, new_group)[0].counted is True
