"""Which rank holds which stage on unequal devices: grouping by speed, ordering the groups by the
predicted split, refusing bad rank orders (pure, without processes); then on 2 and 4 processes,
placed ranks that train as plain training."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from lightning_pipe import PipelineStrategy
from lightning_pipe.partition.solvers.costs import LayerCost, Profile, in_flight_microbatches
from lightning_pipe.partition.solvers.rank_order import (
    BETTER_BY,
    BalanceTarget,
    check_rank_order,
    classes,
    describe_order,
    groups_by_value,
    measured_order,
    place_ranks,
    position_load,
)
from lightning_pipe.partition.solvers.speeds import position_values, stage_values
from lightning_pipe.schedules import stage_positions
from tests.models import SkewedNet, TinyNet, fit_plain, loader, plain_trainer
from tests.pipeline import assert_same_weights, fit_pipeline, twins


def _profile(seconds: list[float], activation: int = 0, static: int = 0) -> Profile:
    layers = tuple(LayerCost(t / 3, 2 * t / 3, static, 0, 0, activation, activation, activation) for t in seconds)
    return Profile(layers, 4, "cpu", 1)


def test_equal_or_unknown_values_keep_the_default_layout() -> None:
    assert place_ranks(None, 2, 2) == ()
    assert place_ranks([1.0, 1.0, 1.0, 1.0], 2, 2) == ()
    assert place_ranks([1.0, 0.96, 1.0, 0.97], 2, 2) == ()  # within 10%: a probe's noise
    assert place_ranks([1.0, 1.0, 0.5, 0.5], 2, 2) == ()  # each stage's replicas already equal
    assert place_ranks([1.0, 0.5], 2, 1) == ()  # one pipeline and no score: nothing to group


def test_a_stages_replicas_are_grouped_by_speed() -> None:
    """One fast and one slow rank per node: the default layout puts a slow rank in every stage, so every
    stage runs at the slow speed; grouping puts both fast ranks on one stage and both slow on the other."""
    assert place_ranks([1.0, 0.5, 1.0, 0.5], 2, 2) == (0, 2, 1, 3)
    assert place_ranks([0.5, 1.0, 0.5, 1.0], 2, 2) == (0, 2, 1, 3)  # groups keep the order of their lowest rank
    assert position_values([1.0, 0.5, 1.0, 0.5], 2, 2) == [0.5, 0.5]
    assert position_values([1.0, 0.5, 1.0, 0.5], 2, 2, (0, 2, 1, 3)) == [1.0, 0.5]
    assert place_ranks([1.0, 0.3, 0.6, 1.0, 0.3, 0.6], 3, 2) == (0, 3, 1, 4, 2, 5)


def test_grouping_maximises_the_sum_of_the_stages_slowest_speeds() -> None:
    """What a speed-weighted split can use is the sum of each stage's slowest replica: grouping by
    sorted speed is the best of every grouping (checked against all of them)."""
    speeds = [0.9, 0.2, 0.7, 0.4, 1.0, 0.5]
    best = max(
        sum(min(speeds[r] for r in perm[i : i + 2]) for i in range(0, 6, 2))
        for perm in itertools.permutations(range(6))
    )
    order = place_ranks(speeds, 3, 2)
    assert sum(position_values(speeds, 3, 2, order)) == pytest.approx(best)


def test_speed_classes_absorb_noise_but_not_real_differences() -> None:
    assert classes([1.0, 0.95, 0.5, 0.52, 0.3]) == [1.0, 1.0, 0.52, 0.52, 0.3]
    assert groups_by_value([1.0, 0.95, 0.5, 0.52], 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="groups of 2"):
        groups_by_value([1.0, 0.5, 0.2], 2)


def test_a_heavy_last_layer_goes_to_the_faster_rank() -> None:
    """Seven layers of 1 s and a last one of 8 s over a fast (1.0) and a slow (0.25) rank: on the slow
    rank the last layer alone takes 32 s; swapped, the split is 3 layers (12 s) and 4 + 8 s (12 s)."""
    profile, in_flight = _profile([1.0] * 7 + [8.0]), in_flight_microbatches("1f1b", 2, 4)
    time = BalanceTarget("time", "1f1b", "never", num_stages=2, num_microbatches=4)
    assert measured_order(profile, [1.0, 0.25], time, in_flight) == (1, 0)
    # equal layers: either order splits as well, so the default stays
    assert measured_order(_profile([1.0] * 8), [1.0, 0.25], time, in_flight) == ()
    assert measured_order(profile, [1.0, 0.95], time, in_flight) == ()


def test_the_larger_memory_takes_the_first_stage_where_it_holds_more_micro_batches() -> None:
    """1F1B on 4 stages holds 4, 3, 2, 1 micro-batches' activations: with the largest device last,
    the 8 layers cannot be split to fit as well as with it first, which the order moves it to; with the
    largest device already first, the default stays."""
    profile = _profile([1.0] * 8, activation=100, static=10)
    in_flight = in_flight_microbatches("1f1b", 4, 8)
    assert in_flight == [4, 3, 2, 1]
    memory = BalanceTarget("memory", "1f1b", "never", num_stages=4, num_microbatches=8)
    order = measured_order(profile, [1e3, 1e3, 1e3, 8e3], memory, in_flight)
    assert order == (3, 0, 1, 2)
    assert measured_order(profile, [8e3, 1e3, 1e3, 1e3], memory, in_flight) == ()


def test_an_order_must_be_better_by_a_margin_to_move_ranks() -> None:
    calls: list[list[float]] = []

    def score(per_position: list[float]) -> float:  # every other order 1% better than the default
        calls.append(per_position)
        return 1.0 if per_position == [1.0, 0.5] else 1.0 - BETTER_BY / 2

    assert place_ranks([1.0, 0.5], 2, 1, score) == ()
    assert [1.0, 0.5] in calls and [0.5, 1.0] in calls
    assert place_ranks([1.0, 0.5], 2, 1, lambda v: 1.0 if v == [1.0, 0.5] else 0.5) == (1, 0)


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("zbv", 2), ("interleaved_1f1b", 2), ("chimera", 1)])
def test_the_chosen_order_predicts_no_worse_than_the_default(schedule: str, virtual: int) -> None:
    """Whatever the schedule's placement of stages, the chosen order's predicted slowest position is
    at most the default layout's, and every stage's load is counted once per copy."""
    profile = _profile([1.0, 2.0, 1.0, 3.0, 1.0, 1.0, 2.0, 4.0])
    stages, speeds = 2, [0.4, 1.0]
    in_flight = in_flight_microbatches(schedule, stages, 4, virtual)
    positions = stage_positions(schedule, stages, virtual)
    num_split = stages * virtual

    def predicted(order: tuple[int, ...]) -> float:
        per_position = position_values(speeds, stages, 1, order)
        counts = profile.balance("time", num_split, in_flight, speeds=stage_values(per_position, positions, num_split))
        load = position_load(profile, "time", counts, positions, in_flight, "never")
        assert sum(load) == pytest.approx(sum(profile.time_costs()) * len(positions) // num_split)
        return max(x / v for x, v in zip(load, per_position))

    order = measured_order(profile, speeds, BalanceTarget("time", schedule, "never", stages, 4, virtual), in_flight)
    assert predicted(order) <= predicted(())


def test_bad_rank_orders_are_refused_saying_what_is_wrong_and_naming_the_fix() -> None:
    assert check_rank_order(None) is None
    assert check_rank_order([1, 0, 3, 2], 4) == [1, 0, 3, 2]
    for bad, wrong in [
        ([0, 0], "names rank 0 more than once and leaves out rank 1"),
        ([1, 2], "names rank 2 outside 0..1 and leaves out rank 0"),
        ("01", "not a list of global ranks"),
        (3, "not a list of global ranks"),
        ([0, True], "True is a truth value, not a global rank"),
        ([0.0, 1.0], r"0.0 \(float\) is not a global rank \(an integer\)"),
        (np.array([[0, 1]]), r"array\(\[0, 1\]\) \(ndarray\) is not a global rank \(an integer\)"),
    ]:
        with pytest.raises(ValueError, match=rf"rank_order=.*\): {wrong}; give each global rank"):
            check_rank_order(bad)
    with pytest.raises(ValueError, match="names 2 ranks for 4 processes; give each global rank of 4 processes once"):
        check_rank_order([1, 0], 4)


def test_a_rank_order_of_numpy_or_torch_integers_is_taken_as_python_integers() -> None:
    """Such as ``rank_order=np.argsort(speeds)``: the config holds a list of Python integers (it is
    printed in reports and saved in checkpoints' hyperparameters)."""
    for order in ([np.int64(1), np.int64(0)], np.array([1, 0]), (np.int32(1), np.int32(0)), torch.tensor([1, 0])):
        config = PipelineStrategy(rank_order=order).config  # type: ignore[arg-type]
        assert config.rank_order == [1, 0] and all(type(r) is int for r in config.rank_order), order
        assert check_rank_order(order, 2) == [1, 0]


def test_the_order_is_described_stage_by_stage() -> None:
    assert describe_order((0, 2, 1, 3), 2, 2) == "stage 0 on ranks 0, 2; stage 1 on ranks 1, 3"
    assert describe_order((1, 0), 2, 1) == "stage 0 on rank 1; stage 1 on rank 0"
    assert describe_order((), 2, 1) == "stage 0 on rank 0; stage 1 on rank 1"


class _RecordPlacement(L.Callback):
    """Each rank's layout, stage, replica and split, written to ``<folder>/rank<k>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        record = {
            "order": list(strategy.layout.order),
            "stage": strategy.stage,
            "replica": strategy.replica,
            "balance": strategy.stage_balance,
            "pipeline": strategy.pipeline.placement.pipeline_ranks,
        }
        Path(self.folder, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def test_ranks_placed_by_their_speeds_train_as_plain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 stages x 2 replicas, ranks 1 and 3 said to run at half speed: ranks 0 and 2 hold stage 0 and
    take more layers, ranks 1 and 3 stage 1; every rank agrees, the process groups follow, and the
    weights equal plain training on the global batch. The layers' costs are given (equal), not measured, so
    that what the test asserts never rests on a loaded machine's timings (the forked ranks inherit the patch)."""
    monkeypatch.setattr(
        "lightning_pipe.partition.measure.measured.profile_module",
        lambda m, layers, *a, **k: _profile([1.0] * len(layers)),
    )
    torch.manual_seed(0)
    reference, piped = twins(SkewedNet(heavy=1.0))
    fit_plain(reference, data=loader(64, 24), max_steps=3)
    fit_pipeline(
        piped, 4, data=loader(64, 12), stages=2, schedule="1f1b", balance="time", rank_speeds=[1.0, 0.5, 1.0, 0.5],
        chunks=3, max_steps=3, callbacks=[_RecordPlacement(str(tmp_path))],
    )  # fmt: skip
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    order = records[0]["order"]
    assert all(r["order"] == order for r in records) and order in ([0, 2, 1, 3], [1, 3, 0, 2])
    fast = records[0]["stage"]
    assert [r["stage"] for r in records] == [fast, 1 - fast, fast, 1 - fast]
    assert [r["replica"] for r in records] == [0, 0, 1, 1]
    assert all(sorted(r["pipeline"]) == [2 * r["replica"], 2 * r["replica"] + 1] for r in records)
    balance = records[0]["balance"]
    assert all(r["balance"] == balance for r in records) and balance[fast] > balance[1 - fast]
    assert sum(balance) == 14 and balance[fast] >= 9  # equal layers at speeds 1 and 0.5: about 2 to 1
    assert_same_weights(reference, piped)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_given_rank_order_trains_as_plain(tmp_path: Path, schedule: str) -> None:
    """``rank_order=[1, 0]``: rank 1 holds the first position (under ZB-V's V, stages 0 and 3, so the
    loss is computed there) and rank 0 the second; the whole weights still come back from rank 0."""
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference, data=loader(48, 12), max_steps=3)
    fit_pipeline(
        piped, 2, data=loader(48, 12), schedule=schedule, rank_order=[1, 0], chunks=4, max_steps=3,
        callbacks=[_RecordPlacement(str(tmp_path))],
    )  # fmt: skip
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["stage"] for r in records] == [1, 0] and records[0]["pipeline"] == [1, 0]
    assert_same_weights(reference, piped)


def test_a_checkpoint_of_a_placed_layout_resumes_under_the_default_one(tmp_path: Path) -> None:
    """Checkpoint files are per stage, not per rank: two epochs with rank 1 on the first stage, then a
    third with rank 0 there, equal three plain epochs."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.models import LifecycleNet

    epochs = {"max_steps": -1}
    torch.manual_seed(0)
    initial = LifecycleNet().state_dict()
    three = LifecycleNet()
    three.load_state_dict(initial)
    fit_plain(three, max_epochs=3, **epochs)
    two = LifecycleNet()
    two.load_state_dict(initial)
    saving = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit_pipeline(
        two, 2, chunks=4, rank_order=[1, 0], max_epochs=2, enable_checkpointing=True, callbacks=[saving], **epochs
    )
    resumed = LifecycleNet()
    fit_pipeline(resumed, 2, ckpt_path=str(tmp_path / "last.ckpt"), chunks=4, max_epochs=3, **epochs)
    assert_same_weights(three, resumed)


@pytest.mark.parametrize(
    "devices, options",
    [(2, {"schedule": "zbv", "rank_order": [1, 0]}), (4, {"stages": 2, "rank_order": [1, 0, 3, 2]})],
    ids=["zbv-last-stage-on-rank-1", "2x2-rank-0-first-of-replica-1"],
)
def test_predictions_reach_rank_0_wherever_it_sits(devices: int, options: dict) -> None:
    """Rank 0 returns the predictions though another rank computes them: under ZB-V with rank 1 first,
    the last stage sits on rank 1; on 2 x 2 with ``[1, 0, 3, 2]``, rank 0 is replica 1's first stage
    and rank 2 its last."""
    from tests.models import LifecycleNet
    from tests.pipeline import pipeline_trainer

    torch.manual_seed(0)
    model = LifecycleNet()
    expected = torch.cat(plain_trainer().predict(model, loader(batch_size=12)))
    predictions = pipeline_trainer(devices, chunks=4, **options).predict(model, loader(batch_size=12))
    assert predictions is not None and len(predictions) == 6
    torch.testing.assert_close(torch.cat(predictions), expected, rtol=1e-4, atol=1e-6)
