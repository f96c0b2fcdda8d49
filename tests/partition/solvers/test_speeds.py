"""Unequal devices: the speed-weighted split, per-rank values per stage, gathering them, the probe;
and on 2 processes, given speeds that give the slower rank fewer layers while training as plain."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_pipe.config import PipelineConfig
from lightning_pipe.partition.measure.measured import RankResources, agreed_resources, split_resources
from lightning_pipe.partition.solvers.balance import balance_by_cost
from lightning_pipe.partition.solvers.costs import LayerCost, Profile, in_flight_microbatches
from lightning_pipe.partition.solvers.speeds import (
    all_equal,
    balance_by_speed,
    bottleneck,
    check_speeds_for_world,
    free_bytes,
    position_values,
    probe_timings,
    relative,
    speeds_from_seconds,
    speeds_from_timings,
    stage_values,
)
from lightning_pipe.schedules import stage_positions
from tests.models import RecordSplit, SkewedNet, fit_plain, loader
from tests.pipeline import assert_same_weights, fit_pipeline, twins


def _brute_force(costs: list[float], speeds: list[float]) -> float:
    """The least slowest stage over every contiguous split."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), len(speeds) - 1):
        bounds = (0, *cuts, n)
        balance = [b - a for a, b in itertools.pairwise(bounds)]
        best = min(best, bottleneck(costs, balance, speeds))
    return best


def test_a_slower_rank_gets_fewer_layers_of_equal_cost() -> None:
    assert balance_by_speed([1.0] * 12, [1.0, 0.5]) == [8, 4]  # 8 / 1 = 4 / 0.5
    assert balance_by_speed([1.0] * 12, [0.5, 1.0]) == [4, 8]
    # 4, 4, 2, 3 seconds: the least bottleneck (4), and of those the most even (4, 3, 4, 3 is less so)
    assert balance_by_speed([1.0] * 12, [1.0, 1.0, 0.5, 1.0]) == [4, 4, 1, 3]


def test_hand_checked_small_cases() -> None:
    # [4, 1, 1, 1, 1] over speeds 1 and 0.25: [3, 2] costs max(6, 2 / 0.25 = 8) = 8, [4, 1] max(7, 4) = 7
    assert balance_by_speed([4.0, 1.0, 1.0, 1.0, 1.0], [1.0, 0.25]) == [4, 1]
    # the heavy first layer alone on the slow rank costs 16; anything more costs more
    assert balance_by_speed([4.0, 1.0, 1.0, 1.0, 1.0], [0.25, 1.0]) == [1, 4]
    assert bottleneck([4.0, 1.0, 1.0, 1.0, 1.0], [4, 1], [1.0, 0.25]) == 7.0


@pytest.mark.parametrize("seed", range(6))
def test_the_speed_weighted_split_is_the_exact_minimum(seed: int) -> None:
    rng = random.Random(seed)
    costs = [rng.uniform(0.1, 5.0) for _ in range(rng.randint(4, 9))]
    speeds = [rng.choice([0.3, 0.5, 1.0, 2.0]) for _ in range(rng.randint(2, 4))]
    if all_equal(speeds):
        speeds[0] *= 3.0
    balance = balance_by_speed(costs, speeds)
    assert sum(balance) == len(costs) and min(balance) >= 1
    assert bottleneck(costs, balance, speeds) == pytest.approx(_brute_force(costs, speeds))


@pytest.mark.parametrize("speeds", [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [1.0, 1.05, 0.97]])
def test_equal_speeds_give_todays_split_exactly(speeds: list[float]) -> None:
    rng = random.Random(1)
    for _ in range(20):
        costs = [rng.uniform(0.0, 3.0) for _ in range(10)]
        assert balance_by_speed(costs, speeds) == balance_by_cost(costs, 3)


def test_the_profiles_time_and_memory_splits_take_speeds_and_capacities() -> None:
    layers = tuple(LayerCost(1.0, 2.0, 100, 100, 0, 50, 10, 10) for _ in range(12))
    profile = Profile(layers, 4, "cpu", 3)
    in_flight = in_flight_microbatches("1f1b", 2, 4)
    today = profile.balance("time", 2, in_flight)
    assert profile.balance("time", 2, in_flight, speeds=[1.0, 1.0]) == today == [6, 6]
    assert profile.balance("time", 2, in_flight, speeds=[1.0, 0.5]) == [8, 4]
    # memory: the first 1F1B stage holds 2 micro-batches, the second 1; a device with half the room gets less
    equal_memory = profile.balance("memory", 2, in_flight)
    assert profile.balance("memory", 2, in_flight, capacities=[8e9, 8e9]) == equal_memory
    halved = profile.balance("memory", 2, in_flight, capacities=[8e9, 4e9])
    assert halved[1] < equal_memory[1]
    with pytest.raises(ValueError, match="speeds has 3 entries for 2 stages"):
        profile.balance("time", 2, in_flight, speeds=[1.0, 1.0, 1.0])


def test_per_rank_values_become_per_position_and_per_stage_values() -> None:
    # 2 stages x 2 replicas: rank r is position r // 2; a position is as slow as its slower replica
    assert position_values([1.0, 0.5, 0.8, 0.9], 2, 2) == [0.5, 0.8]
    # ZB-V: stages 0 and 3 on position 0, stages 1 and 2 on position 1
    assert stage_values([1.0, 0.5], stage_positions("zbv", 2, 2), 4) == [1.0, 0.5, 0.5, 1.0]
    # Chimera keeps each stage twice, on two positions: the slower holder counts
    positions = stage_positions("chimera", 2, 1)
    assert stage_values([1.0, 0.5], positions, 2) == [0.5, 0.5]
    assert relative([2.0, 1.0]) == [1.0, 0.5] and speeds_from_seconds([0.1, 0.2, 0.05]) == [0.5, 0.25, 1.0]
    speeds, capacities = split_resources(RankResources([1.0, 0.5], [8, 4]), "interleaved_1f1b", 2, 1, 2)
    assert speeds == [1.0, 0.5, 1.0, 0.5] and capacities == [8.0, 4.0, 8.0, 4.0]
    assert split_resources(RankResources([1.0, 0.5], [8, None]), "1f1b", 2, 1, 1) == ([1.0, 0.5], None)


def test_resources_are_gathered_from_every_rank() -> None:
    """Each rank's probe seconds and free memory reach every rank; the speeds are relative to rank 0."""
    cpu = torch.device("cpu")

    def gather(mine: tuple | None) -> list[tuple | None]:
        if mine is None:  # the start line before the probe
            return [None, None]
        return [mine, (None if mine[0] is None else [2 * t for t in mine[0]], mine[1])]  # rank 1: twice as long

    found = agreed_resources(gather, cpu, None, 2, speeds=True, memory=True, probe=lambda device: [0.25, 0.26, 0.25])
    assert found.speeds == [1.0, 0.5] and found.measured and found.free is not None and len(found.free) == 2
    assert "rank 1 0.50" in found.describe() and "measured by a probe" in found.describe()
    given = agreed_resources(gather, cpu, [2.0, 4.0], 2, probe=lambda device: pytest.fail("the speeds were given"))
    assert given.speeds == [1.0, 2.0] and not given.measured and given.free is None
    assert agreed_resources(None, cpu, None, 1) == RankResources()  # one process: nothing to weigh
    with pytest.raises(ValueError, match="gives 3 speeds for 2 processes"):
        agreed_resources(gather, cpu, [1.0, 1.0, 1.0], 2)
    assert check_speeds_for_world([1, 2], 2) == [1.0, 2.0]
    assert "equal within 10%" in RankResources([1.0, 0.95]).describe()


def test_speeds_from_repeated_timings_count_differences_within_the_noise_as_equal() -> None:
    """The probe's statistic, on made-up timings: each rank's median, ranks whose spreads overlap (give or
    take 10%) equal, so a noisy host does not move stages; a difference beyond the noise still does."""
    # two equal cores, one shared with another process for a while: medians 0.10 and 0.17 s (which the
    # median alone calls 0.58x), but the spreads overlap: equal
    noisy = [
        [0.10, 0.10, 0.11, 0.10, 0.19, 0.20, 0.10, 0.18, 0.10],
        [0.17, 0.10, 0.18, 0.10, 0.17, 0.19, 0.11, 0.17, 0.10],
    ]
    assert speeds_from_seconds([0.10, 0.17])[1] < 0.6 and speeds_from_timings(noisy) == [1.0, 1.0]
    assert speeds_from_timings(noisy[::-1]) == [1.0, 1.0]  # and the same the other way round
    # a steady rank twice as slow: 0.5, whatever its place
    steady = [[0.10, 0.11, 0.10, 0.10, 0.12], [0.20, 0.21, 0.20, 0.22, 0.20]]
    assert speeds_from_timings(steady) == pytest.approx([1.0, 0.5])
    assert speeds_from_timings(steady[::-1]) == pytest.approx([0.5, 1.0])
    # within 10% without noise: equal; two classes of two ranks each: each class its median's speed
    assert speeds_from_timings([[0.100] * 3, [0.105] * 3]) == [1.0, 1.0]
    classes = [[0.10, 0.10, 0.10], [0.20, 0.20, 0.21], [0.10, 0.10, 0.10], [0.21, 0.20, 0.20]]
    assert speeds_from_timings(classes) == pytest.approx([1.0, 0.5, 1.0, 0.5])
    assert speeds_from_timings([[0.3], [0.1]]) == pytest.approx([1 / 3, 1.0])  # one repeat: its value


@pytest.mark.slow  # it measures: the default run asserts nothing that a measured speed decides
def test_the_probe_takes_time_and_leaves_the_random_state_alone() -> None:
    state = torch.random.get_rng_state()
    seconds = probe_timings(torch.device("cpu"), repeats=2)
    assert len(seconds) == 2 and min(seconds) > 0.0 and torch.equal(state, torch.random.get_rng_state())
    free = free_bytes(torch.device("cpu"))
    assert free is None or free > 0


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"balance": "time", "rank_speeds": [1.0, 0.0]}, "one positive number per process"),
        ({"balance": "time", "rank_speeds": "fast"}, "one positive number per process"),
        ({"balance": "time", "rank_speeds": [1.0, True]}, "one positive number per process"),
        ({"balance": "time", "rank_speeds": [1.0, np.bool_(True)]}, "one positive number per process"),
        ({"balance": "time", "rank_speeds": [1.0, 1j]}, "one positive number per process"),
        ({"balance": "time", "rank_speeds": torch.ones(2, 2)}, "one positive number per process"),
        ({"balance": "uniform", "rank_speeds": [1.0, 0.5]}, "Give balance='time'"),
    ],
)
def test_bad_rank_speeds_are_refused_naming_the_fix(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**arguments)
    assert PipelineConfig(plan="auto", rank_speeds=[1.0, 0.5]).rank_speeds == [1.0, 0.5]


def test_rank_speeds_take_numpy_and_torch_reals() -> None:
    """Speeds computed with numpy or torch are taken as Python floats, the container too."""
    for speeds in ([np.float32(1.0), np.float64(0.5)], np.array([1.0, 0.5], dtype=np.float32), torch.tensor([1.0, 0.5]),
                   [torch.tensor(1.0), np.int64(2)]):  # fmt: skip
        taken = PipelineConfig(balance="time", rank_speeds=speeds).rank_speeds
        assert taken == [float(s) for s in speeds] and all(type(s) is float for s in taken)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_given_speeds_give_the_slower_rank_fewer_layers_and_train_as_plain(tmp_path: Path, schedule: str) -> None:
    """2 processes, rank 1 said to run at half speed: the split weighs each stage by the speed of the
    rank the run placed there (under ZB-V's V position r holds stages r and 3 - r), every rank
    splits and places alike, and the weights after training equal plain training's. Which position
    the slower rank takes, and how many layers it gets, follow the profile measured in the run (its
    layers cost the same only on an idle machine): the test reads both from the run's records and
    checks the split against that profile, so a loaded machine cannot fail it."""
    torch.manual_seed(0)
    reference, piped = twins(SkewedNet(heavy=1.0))
    fit_plain(reference, data=loader(64, 16), max_steps=3)
    fit_pipeline(
        piped, 2, data=loader(64, 16), schedule=schedule, balance="time", rank_speeds=[1.0, 0.5], chunks=4,
        max_steps=3, callbacks=[RecordSplit(str(tmp_path))],
    )  # fmt: skip
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    balance, profile, order = records[0]["balance"], records[0]["profile"], records[0]["order"]
    assert records[1]["balance"] == balance and records[1]["order"] == order
    assert sorted(r["position"] for r in records) == [0, 1]
    assert records[0]["resources"].speeds == [1.0, 0.5] and not records[0]["resources"].measured
    positions = stage_positions(schedule, 2, len(balance) // 2)
    in_flight = in_flight_microbatches(schedule, 2, 4, len(balance) // 2)
    speeds = stage_values(position_values([1.0, 0.5], 2, 1, order), positions, len(balance))
    assert balance == profile.balance("time", len(balance), in_flight, speeds=speeds)

    def slowest(split: list[int]) -> float:  # the predicted step's slowest stage, at its rank's speed
        return max(t / v for t, v in zip(profile.stage_seconds(split), speeds))

    # the speeds weigh the split: it is no slower than the split that ignores them (the layer counts
    # could be equal or reversed where the measured profile makes the first layers cheap)
    assert slowest(balance) <= slowest(profile.balance("time", len(balance), in_flight)) + 1e-12
    assert_same_weights(reference, piped)


def test_the_command_line_gives_rank_speeds_as_numbers() -> None:
    from lightning_pipe.cli import build_strategy
    from tests.test_cli import _compose

    cfg = _compose(["strategy.balance=time", "strategy.rank_speeds=[1,0.5]", "strategy.rank_order=[1,0]"])
    strategy, _ = build_strategy(cfg.strategy, 2)
    assert strategy.config.rank_speeds == [1.0, 0.5] and strategy.config.balance == "time"
    assert strategy.config.rank_order == [1, 0] and all(type(r) is int for r in strategy.config.rank_order)
