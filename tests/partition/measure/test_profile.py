"""Profiles and the splits behind balance="time" and "memory": the pure cost model, the
measurement on one process, and the whole path under the pipeline on 2 processes."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_pipe.partition.measure.profile import (
    Timing,
    agreed_profile,
    measure_layers,
    profile_module,
    sequential_input,
)
from lightning_pipe.partition.solvers.costs import LayerCost, Profile, in_flight_microbatches
from lightning_pipe.partition.solvers.speeds import position_values
from lightning_pipe.trainer.dataloaders.loaders import configured_optimizers
from tests.models import HIDDEN, IN, DeferredNet, RecordSplit, SkewedNet, TinyNet, WaitingLayer, WrappedNet, loader
from tests.pipeline import fit_pipeline


def _layer(forward: float = 1.0, static: int = 0, saved: int = 0, inputs: int = 0) -> LayerCost:
    return LayerCost(forward, 2 * forward, static, 0, 0, saved, inputs, 0)


def _profile(layers: list[LayerCost]) -> Profile:
    return Profile(tuple(layers), 4, "cpu", 3)


def _brute_force(n: int, stages: int, cost: Any) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(cost(s, a, b) for s, (a, b) in enumerate(itertools.pairwise(bounds))))
    return best


def test_time_balance_moves_layers_off_the_slow_stage() -> None:
    profile = _profile([_layer(4.0)] * 6 + [_layer(1.0)] * 6)
    balance = profile.balance("time", 2, [2, 1])
    assert balance == [4, 8]  # 48 vs 42 units instead of 66 vs 24 for [6, 6]
    assert max(profile.stage_seconds(balance)) == 48.0
    assert profile.stage_seconds([6, 6]) == [72.0, 18.0]
    recomputed = profile.time_costs("always")
    assert recomputed[0] == 4.0 + 4.0 + 8.0  # recomputation adds a forward


@pytest.mark.parametrize("seed", range(4))
def test_memory_balance_is_the_exact_minimum_with_in_flight_activations(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(1, 100, (9, 3), generator=g).tolist()
    profile = _profile([_layer(1.0, static=s, saved=a, inputs=i) for s, a, i in values])
    for schedule, checkpoint in (("1f1b", "never"), ("gpipe", "never"), ("1f1b", "always")):
        in_flight = in_flight_microbatches(schedule, 3, 6)
        balance = profile.balance("memory", 3, in_flight, checkpoint)
        got = max(profile.stage_bytes(balance, in_flight, checkpoint))
        best = _brute_force(9, 3, lambda s, a, b, f=in_flight, c=checkpoint: profile._stage_memory(s, a, b, f, c))
        assert got == best


def test_memory_balance_gives_the_first_1f1b_stage_less_activation() -> None:
    # equal layers: 1F1B's stage 0 holds 2 micro-batches, stage 1 one, so stage 0 gets fewer layers
    profile = _profile([_layer(1.0, static=10, saved=100)] * 9)
    assert in_flight_microbatches("1f1b", 2, 4) == [2, 1]
    assert profile.balance("memory", 2, [2, 1]) == [3, 6]
    assert profile.balance("memory", 2, [4, 4]) == [5, 4]  # GPipe: all equal, as uniform
    assert "stage 0: 3 layers" in profile.report([3, 6], [2, 1])


def test_in_flight_counts_every_stage_of_a_virtual_layout() -> None:
    # interleaved 1F1B, 2 processes x 2 stages: every stage is listed; ZB-V's too
    interleaved = in_flight_microbatches("interleaved_1f1b", 2, 4, 2)
    assert len(interleaved) == 4 and all(count >= 1 for count in interleaved)
    assert len(in_flight_microbatches("zbv", 2, 4, 2)) == 4
    profile = _profile([_layer(1.0, static=10, saved=100)] * 9)
    assert sum(profile.balance("memory", 4, interleaved)) == 9


def test_time_balance_splits_a_virtual_layout_into_every_stage(tmp_path: Path) -> None:
    """balance="time" under interleaved 1F1B splits into processes x virtual stages, alike on
    every rank, and trains as plain training does."""
    from tests.models import fit_plain
    from tests.pipeline import assert_same_weights, twins

    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference)
    fit_pipeline(
        piped, 2, schedule="interleaved_1f1b", balance="time", chunks=4, callbacks=[RecordSplit(str(tmp_path))]
    )
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert records[0]["balance"] == records[1]["balance"] and len(records[0]["balance"]) == 4
    assert_same_weights(reference, piped)


def test_measured_costs_follow_the_layers() -> None:
    layers = nn.Sequential(WaitingLayer(4.0), WaitingLayer(1.0), nn.Tanh())
    costs = measure_layers(layers, torch.randn(4, HIDDEN), torch.device("cpu"), timing=Timing(warmup=1, repeats=3))
    heavy, light, tanh = costs
    # each layer's own wait is inside its times, a lower bound whatever the machine's load (which
    # one measures longer is compared in test_measured_times_follow_the_work, a slow test)
    assert heavy.forward >= 2e-3 and heavy.backward >= 4e-3 and light.forward >= 5e-4 and light.backward >= 1e-3
    assert heavy.parameter_bytes == light.parameter_bytes == (HIDDEN * HIDDEN + HIDDEN) * 4
    assert tanh.parameter_bytes == 0 and tanh.activation_bytes == 4 * HIDDEN * 4  # tanh saves its output
    assert heavy.input_bytes == heavy.output_bytes == 4 * HIDDEN * 4
    assert all(p.grad is None for p in layers.parameters())


def test_split_backward_is_measured_as_b_and_w() -> None:
    """B (input gradient, weight-gradient work deferred) and W (that work) of each layer, as the
    zero-bubble schedules run them; a layer that defers nothing has W = 0."""
    layers = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Conv1d(4, 4, 3, padding=1))
    linear, relu = measure_layers(
        layers[:2], torch.randn(64, 256), torch.device("cpu"), timing=Timing(warmup=1, repeats=5)
    )
    (conv,) = measure_layers(layers[2:], torch.randn(8, 4, 64), torch.device("cpu"), timing=Timing(warmup=1, repeats=5))
    for cost in (linear, conv):
        b, w = cost.split_backward
        assert b > 0 and w > 0  # the deferred weight work is timed apart
    b, w = relu.split_backward
    assert w == 0.0 and b > 0
    assert (
        "forward" not in layers[0].__dict__ and "forward" not in layers[2].__dict__
    )  # the runtime's forwards removed again
    assert all(p.grad is None for p in layers.parameters())
    assert LayerCost(1.0, 2.0, 0, 0, 0, 0, 0, 0).split_backward == (2.0, 0.0)  # not measured: all of it is B


class _Products(TorchDispatchMode):
    """Records each matrix product that runs (its operator and the shape of its result), to tell
    which gradients a backward computes: for ``Linear(n_in, n_out)`` on a batch ``b``, the input
    gradient is a ``(b, n_in)`` product and the weight gradient an ``(n_out, n_in)`` one."""

    def __init__(self) -> None:
        super().__init__()
        self.products: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.products.append((str(func.overloadpacket), tuple(out.shape)))
        return out


def test_the_first_layer_on_data_computes_no_input_gradient() -> None:
    """As in the pipeline: the first stage computes no gradient for data, but does for an input
    that trainable layers outside the Sequential produced (the products that run, whole backward
    and B/W alike; their times are compared in test_measured_times_follow_the_work, a slow test)."""
    layers = nn.Sequential(nn.Linear(48, 32), nn.Linear(32, 24))
    x = torch.randn(8, 48)
    ran = {}
    for name, value in (("on data", x), ("after outside", x.clone().requires_grad_())):
        with _Products() as recorder:
            costs = measure_layers(layers, value, torch.device("cpu"), timing=Timing(warmup=0, repeats=1))
        ran[name] = recorder.products
        assert costs[0].weight_backward > 0 and costs[1].input_backward is not None  # B and W measured
    assert ("aten.mm", (8, 48)) not in ran["on data"]  # no input-gradient product for the first layer
    assert ran["after outside"].count(("aten.mm", (8, 48))) == 2  # in the whole backward and in B
    for products in ran.values():
        assert ("aten.mm", (8, 32)) in products  # the second layer's input gradient, as before
        assert ("aten.mm", (32, 48)) in products and (
            "aten.addmm_",
            (32, 48),
        ) in products  # the weight gradient, whole and as W
    tiny = TinyNet()
    assert sequential_input(tiny, tiny.layers, next(iter(loader(8, 4)))).requires_grad is False
    wrapped = WrappedNet()
    assert sequential_input(wrapped, wrapped.blocks, next(iter(loader(8, 4)))).requires_grad is True


def test_profiling_leaves_no_trace() -> None:
    class Normed(TinyNet):
        def __init__(self) -> None:
            super().__init__(optimizer="adam")
            self.layers = nn.Sequential(
                nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Dropout(0.5), nn.Linear(HIDDEN, 3)
            )

    model = Normed()
    batch = next(iter(loader(24, 12)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    profile = profile_module(
        model, model.layers, lambda: batch, 4, torch.device("cpu"), optimizers=lambda: configured_optimizers(model)
    )
    assert torch.equal(torch.rand(3), expected)  # the random state is as before
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # batch-norm statistics too
    assert profile.microbatch_size == 3 and len(profile.layers) == 4
    first = profile.layers[0]
    assert first.optimizer_bytes == 2 * first.parameter_bytes  # Adam's two moments, measured


def test_meta_built_layers_are_measured_on_temporary_copies() -> None:
    """A model built on the meta device is profiled as a real one is (same bytes, real times), each
    layer on a temporary copy with storage; the model itself stays on the meta device."""
    torch.manual_seed(0)
    real = TinyNet()
    with torch.device("meta"):
        meta = TinyNet()
    data = next(iter(loader(16, 8)))
    measured = {
        name: profile_module(
            model,
            model.layers,
            lambda: data,
            2,
            torch.device("cpu"),
            optimizers=lambda m=model: configured_optimizers(m),
        )
        for name, model in (("real", real), ("meta", meta))
    }
    assert len(measured["meta"].layers) == len(measured["real"].layers) == len(meta.layers)
    for got, expected in zip(measured["meta"].layers, measured["real"].layers):
        for field in (
            "parameter_bytes",
            "gradient_bytes",
            "optimizer_bytes",
            "activation_bytes",
            "input_bytes",
            "output_bytes",
        ):
            assert getattr(got, field) == getattr(expected, field), field
        assert got.forward > 0 and got.backward > 0
    assert measured["meta"].layers[0].optimizer_bytes > 0  # SGD with momentum, found for the copies too
    assert all(t.is_meta for t in meta.state_dict().values())  # no storage left behind


def test_a_model_built_on_the_meta_device_splits_by_measured_memory(tmp_path: Path) -> None:
    fit_pipeline(DeferredNet(), 2, balance="memory", callbacks=[RecordSplit(str(tmp_path))])
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert records[0]["balance"] == records[1]["balance"] and sum(records[0]["balance"]) == 8
    assert records[0]["profile"] is not None and len(records[0]["profile"].layers) == 8


def test_a_failed_measurement_reaches_every_rank() -> None:
    def fail() -> Profile:
        raise ValueError("no data")

    sent: list[Any] = []

    def broadcast(obj: Any) -> Any:
        sent.append(obj)
        return obj

    with pytest.raises(ValueError, match="no data"):
        agreed_profile(True, broadcast, fail)
    assert sent == [(None, "ValueError: no data")]  # what the other ranks receive, and raise:
    with pytest.raises(RuntimeError, match="global rank 0 failed: ValueError: no data"):
        agreed_profile(False, lambda obj: sent[0], fail)


def test_every_rank_measures_at_once_and_the_source_profile_is_used() -> None:
    calls: list[str] = []
    source_profile = Profile((), 4, "cpu", 3)

    def measure_here(name: str) -> Any:
        def measure() -> Profile:
            calls.append(name)
            if name == "other":
                raise MemoryError("this rank's own trouble")
            return source_profile

        return measure

    assert agreed_profile(True, lambda obj: obj, measure_here("source")) is source_profile
    got = agreed_profile(False, lambda obj: (source_profile, None), measure_here("other"))
    assert got is source_profile and calls == ["source", "other"]  # the other rank measured too, its failure ignored
    agreed_profile(False, lambda obj: (source_profile, None), measure_here("quiet"), everywhere=False)
    assert calls == ["source", "other"]


def _run(balance: str, folder: Path) -> tuple[list[int], float, list[Any]]:
    folder.mkdir()
    fit_pipeline(
        SkewedNet(),
        2,
        data=loader(128, 32),
        balance=balance,
        chunks=16,
        max_steps=6,
        callbacks=[RecordSplit(str(folder))],
    )
    records = [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert records[0]["balance"] == records[1]["balance"]  # every rank split alike
    # the fastest step after the first: the machine's other load only ever adds time
    return records[0]["balance"], min(records[0]["times"][1:]), [r["profile"] for r in records]


def test_time_balance_follows_the_measured_profile(tmp_path: Path) -> None:
    """balance="time": every rank splits alike, as the measured profile's time costs say (how much
    faster that split trains is measured in test_time_balance_beats_uniform_on_skewed_layers, slow)."""
    folder = tmp_path / "time"
    folder.mkdir()
    fit_pipeline(
        SkewedNet(),
        2,
        data=loader(64, 32),
        balance="time",
        chunks=16,
        max_steps=1,
        callbacks=[RecordSplit(str(folder))],
    )
    records = [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(2)]
    profile = records[0]["profile"]
    assert profile is not None and profile == records[1]["profile"] and len(profile.layers) == 14
    speeds = records[0]["resources"].speeds  # each rank's speed, timed by the probe on every rank
    assert speeds is not None and len(speeds) == 2 and speeds[0] == 1.0 and records[1]["resources"].speeds == speeds
    # the ranks are placed by speed (the faster may hold either stage): the split weighs each stage by the
    # speed of the rank the run placed there, as every rank recorded it
    order = records[0]["order"]
    assert records[1]["order"] == order and sorted(r["position"] for r in records) == [0, 1]
    assert (
        records[0]["balance"]
        == records[1]["balance"]
        == profile.balance(
            "time", 2, in_flight_microbatches("1f1b", 2, 16), speeds=position_values(speeds, 2, 1, order)
        )
    )


@pytest.mark.slow  # compares wall-clock times, which a loaded machine can reorder
def test_measured_times_follow_the_work() -> None:
    """The timings behind the structural tests above, compared: a layer with more work (or waiting)
    measures longer, B + W is the backward's work timed in two parts, and the first layer on data
    (no input-gradient product) measures a shorter B than the next layer."""
    torch.set_num_threads(1)
    heavy, light = measure_layers(
        nn.Sequential(WaitingLayer(4.0), WaitingLayer(1.0)),
        torch.randn(4, HIDDEN),
        torch.device("cpu"),
        timing=Timing(warmup=1, repeats=3),
    )
    assert heavy.forward > light.forward and heavy.backward > light.backward
    (linear,) = measure_layers(
        nn.Sequential(nn.Linear(256, 256)),
        torch.randn(64, 256).requires_grad_(),
        torch.device("cpu"),
        timing=Timing(warmup=1, repeats=5),
    )
    b, w = linear.split_backward
    assert 0.1 < (b + w) / linear.backward < 10
    layers = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    x = torch.randn(128, 1024)
    on_data = measure_layers(layers, x, torch.device("cpu"), timing=Timing(warmup=1, repeats=5))
    after_outside = measure_layers(layers, x.requires_grad_(), torch.device("cpu"), timing=Timing(warmup=1, repeats=5))
    assert on_data[0].input_backward < 0.5 * on_data[1].input_backward
    assert after_outside[0].input_backward > 0.5 * after_outside[1].input_backward


@pytest.mark.slow  # compares wall-clock step times: four runs in paired rounds
def test_time_balance_beats_uniform_on_skewed_layers(tmp_path: Path) -> None:
    """Six layers cost 4x the other six, at equal parameters: the time split is faster, measured.
    Paired rounds in alternating order, each run's fastest of 5 steps, since the machine's other
    load varies."""
    ratios = []
    for round_ in range(2):
        order = ("uniform", "time") if round_ % 2 == 0 else ("time", "uniform")
        results = {b: _run(b, tmp_path / f"{b}{round_}") for b in order}
        uniform_balance, uniform_time, _ = results["uniform"]
        time_balance, time_time, profiles = results["time"]
        assert uniform_balance == [7, 7]
        assert time_balance in ([5, 9], [4, 10])  # the heavy layers are 1..6
        assert profiles[0] == profiles[1] and profiles[0] is not None  # one profile, on every rank
        ratios.append(time_time / uniform_time)
    print(f"balance='time' step time / uniform, per round: {ratios}")
    assert statistics.mean(ratios) <= 0.85, ratios
