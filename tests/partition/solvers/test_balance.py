import itertools

import pytest

from lightning_pipe.partition import balance_by_cost, balance_uniform, check_balance
from lightning_pipe.partition.solvers.balance import stages_without_parameters


def test_uniform_puts_extra_layers_first() -> None:
    assert balance_uniform(10, 4) == [3, 3, 2, 2]
    assert balance_uniform(8, 2) == [4, 4]
    assert balance_uniform(3, 3) == [1, 1, 1]


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 stages"):
        balance_uniform(3, 4)
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        balance_by_cost([1.0, 1.0], 3)


def _brute_force(costs: list[float], stages: int) -> float:
    best = float("inf")
    n = len(costs)
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize(
    "costs, stages",
    [([1, 2, 3, 4, 5, 6, 7, 8], 3), ([10, 0, 1, 1, 1, 1, 0, 5], 3), ([5, 1, 1, 1, 1, 5], 2), ([3, 3, 3, 3, 3], 5)],
)
def test_by_cost_minimises_the_bottleneck(costs: list[float], stages: int) -> None:
    balance = balance_by_cost(costs, stages)
    assert sum(balance) == len(costs) and len(balance) == stages and min(balance) >= 1
    bounds = [0]
    for n in balance:
        bounds.append(bounds[-1] + n)
    bottleneck = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
    assert bottleneck == pytest.approx(_brute_force(costs, stages))


def test_equal_costs_match_uniform() -> None:
    for n in range(1, 13):
        for p in range(1, n + 1):
            assert balance_by_cost([1.0] * n, p) == balance_uniform(n, p)


def test_negative_cost_is_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        balance_by_cost([1, -1], 1)


@pytest.mark.parametrize(
    "balance, match",
    [
        ([4, 4, 4], "has 3 entries but the pipeline has 2 stages"),
        ([4, 3], "sums to 7 but the module has 8 layers"),
        ([8, 0], "positive integers"),
        ([4.0, 4], "positive integers"),
    ],
)
def test_check_balance_errors_name_the_value(balance: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_balance(balance, 8, 2)


# the README's model: Linear, ReLU, Linear, ReLU, Linear; a lone ReLU would leave its stage's optimizer nothing
README_OWNERS = [True, False, True, False, True]


def test_uniform_moves_a_parameter_free_layer_to_a_neighbour_stage() -> None:
    owners = [True, False, True, False, True, False, True]
    assert balance_uniform(7, 4, owners) == [2, 2, 2, 1]  # equal counts already give each stage a Linear
    assert balance_uniform(6, 3, [True, True, False, False, False, True]) == [1, 3, 2]  # [2, 2, 2]: stage 1 has none
    assert balance_uniform(6, 3) == [2, 2, 2]  # no owners: equal counts, as before


def test_by_cost_gives_every_stage_a_parameter_where_it_can() -> None:
    costs = [8448.0, 0.0, 65792.0, 0.0, 2570.0]
    assert balance_by_cost(costs, 4) == [2, 1, 1, 1]  # stage 2 a lone ReLU
    assert balance_by_cost(costs, 3, README_OWNERS) == [2, 2, 1]
    # 3 layers with parameters cannot fill 4 stages: unconstrained, and the check names the fix
    assert balance_by_cost(costs, 4, README_OWNERS) == [2, 1, 1, 1]
    assert stages_without_parameters([2, 1, 1, 1], README_OWNERS) == [2]


def test_a_split_leaving_a_process_without_parameters_is_refused_naming_the_fix() -> None:
    from torch import nn

    from lightning_pipe.partition import check_stage_parameters, layer_owners, resolve_balance

    layers = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    owners = layer_owners(layers)
    assert owners == README_OWNERS
    for mode in ("uniform", "parameters"):
        balance = resolve_balance(mode, layers, 4)
        with pytest.raises(
            ValueError,
            match=r"stage 2 .*\(3: ReLU\).*empty parameter list.*3 such layer\(s\) for 4 stages: use at most 3",
        ):
            check_stage_parameters(balance, layers, [[0], [1], [2], [3]], owners)
    assert resolve_balance("uniform", layers, 3) == [2, 2, 1]
    check_stage_parameters([2, 2, 1], layers, [[0], [1], [2]], owners)  # every stage holds a Linear
    with pytest.raises(ValueError, match=r"balance=\[1, 1, 3\] leaves stage 1 .*for example balance=\[2, 2, 1\]"):
        check_stage_parameters([1, 1, 3], layers, [[0], [1], [2]], owners)
    # two stages per process (interleaved): a process holding a Linear elsewhere is fine
    check_stage_parameters([2, 1, 1, 1], layers, [[0, 2], [1, 3]], owners)
