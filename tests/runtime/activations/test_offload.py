"""Offload of saved activations to host memory, in one process: a middle stage run in 1F1B's order (and in
GPipe's, whose backwards run in reverse)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from lightning_pipe.runtime.activations.meter import SavedActivationMeter
from lightning_pipe.runtime.activations.offload import ActivationOffload
from lightning_pipe.runtime.activations.policy import offload_per_stage, recompute_per_stage
from lightning_pipe.runtime.crossing.seam import Packing
from lightning_pipe.runtime.stage import StageModule, StageRunner
from lightning_pipe.schedules import traits

IN, WIDTH, MICRO, CHUNKS = 8, 64, 16, 6


def _stage() -> StageModule:
    torch.manual_seed(0)
    layers = [nn.Linear(IN, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, IN)]
    return StageModule(OrderedDict((str(i), layer) for i, layer in enumerate(layers)), stage=1, num_stages=4)


def _one_f_one_b(in_flight: int) -> list[tuple[str, int]]:
    """A stage's 1F1B order holding ``in_flight`` micro-batches at its peak."""
    order = [("F", i) for i in range(in_flight)]
    for i in range(CHUNKS - in_flight):
        order += [("B", i), ("F", i + in_flight)]
    return order + [("B", i) for i in range(CHUNKS - in_flight, CHUNKS)]


def _gpipe() -> list[tuple[str, int]]:
    """A stage's GPipe order: every forward, then the backwards newest first."""
    return [("F", i) for i in range(CHUNKS)] + [("B", i) for i in reversed(range(CHUNKS))]


def _run(
    offload: int | None, split: bool = False, device: str = "cpu", order: list[tuple[str, int]] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], StageRunner, int]:
    """Gradients of the weights and of the inputs, the runner and its meter's peak."""
    stage = _stage().to(device)
    runner = StageRunner(stage, offload=offload)
    meter = SavedActivationMeter(stage.parameters())
    runner.meter = meter
    torch.manual_seed(1)
    inputs = [torch.randn(MICRO, IN).to(device) for _ in range(CHUNKS)]
    grads = [torch.randn(MICRO, IN).to(device) for _ in range(CHUNKS)]
    input_grads: list[torch.Tensor] = []
    for kind, i in order or _one_f_one_b(3):
        if kind == "F":
            runner.forward(i, CHUNKS, ([inputs[i].clone()], (True,), Packing()))
        elif split:
            input_grads += runner.backward_input(i, [grads[i]]) or []
            runner.backward_weight(i)
        else:
            input_grads += runner.backward(i, [grads[i]]) or []
    return [p.grad.clone() for p in stage.parameters()], input_grads, runner, meter.peak


@pytest.mark.parametrize("split", [False, True])
def test_offload_is_exact_and_its_bytes_leave_the_stage(split: bool) -> None:
    weights, inputs, _, kept_peak = _run(None, split)
    for keep in (0, 1, 2):
        w, i, runner, peak = _run(keep, split)
        for a, b in zip(w + i, weights + inputs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same values, copied exactly
        offload = runner.offload
        assert offload is not None and not offload.held and offload.host_bytes == 0  # all released
        assert offload.peak_host_bytes > 0
        one = kept_peak // 3  # the stage holds 3 micro-batches at its peak without offload
        # on the device: ``keep`` micro-batches' saved tensors from their forwards, and one brought back
        assert peak == min(keep + 1, 3) * one, (keep, peak, kept_peak)
        # the others went to host memory, each tensor once (a tensor saved by two operations is copied once)
        assert offload.peak_host_bytes == (3 - keep) * one
    assert kept_peak > 0


def test_under_gpipe_the_next_backward_is_brought_back() -> None:
    """GPipe runs its backwards newest first: after each backward the offloaded micro-batch that comes back
    is the next one in that order (not the oldest), so the device holds ``keep`` plus one."""
    weights, inputs, _, kept_peak = _run(None, order=_gpipe())
    one = kept_peak // CHUNKS
    for keep in (0, 2):
        w, i, _, peak = _run(keep, order=_gpipe())
        for a, b in zip(w + i, weights + inputs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert peak == (keep + 1) * one, (keep, peak, one)


def test_parameters_are_never_copied() -> None:
    stage = _stage()
    offload = ActivationOffload(0)
    offload.ignore(stage.parameters())
    with offload.hooks(0):
        stage.run_layers(torch.randn(2, IN, requires_grad=True), recompute=False).sum().backward()
    assert offload.peak_host_bytes > 0
    weights = sum(p.numel() * p.element_size() for p in stage.parameters() if p.dim() == 2)
    activations = offload.peak_host_bytes
    assert activations < weights  # a 2-sample batch: only activations, no weight matrix was copied


def test_tensors_on_the_meta_device_are_left_alone() -> None:
    """A stand-in of the embeddings another stage holds runs their copy on the meta device inside the
    stage's forward (a Hugging Face block container's later stages): what it saves has no data (before:
    'Cannot copy out of meta tensor', found by the conformance matrix's model that records hidden states)."""
    embedding = nn.Embedding(5, 3, device="meta")
    offload = ActivationOffload(0)
    with offload.hooks(0):
        out = embedding(torch.tensor([[1, 2]], device="meta"))
    assert out.is_meta and offload.peak_host_bytes == 0


def test_offload_per_stage_values() -> None:
    assert offload_per_stage(False, traits("1f1b"), 4, 8, 1) == (None,) * 4
    assert offload_per_stage(True, traits("1f1b"), 2, 4, 1) == (0, 0)
    assert offload_per_stage([2, None], traits("1f1b"), 2, 4, 1) == (2, None)
    # 1F1B: stage s holds 4 - s, the last 1
    assert offload_per_stage("auto", traits("1f1b"), 4, 8, 1) == (0, 0, 0, None)
    assert offload_per_stage("auto", traits("gpipe"), 2, 4, 1) == (None, None)  # every stage holds all 4
    with pytest.raises(ValueError, match="one per stage"):
        offload_per_stage([1, 1], traits("1f1b"), 4, 8, 1)
    with pytest.raises(ValueError, match="integer k >= 0"):
        offload_per_stage(-1, traits("1f1b"), 2, 4, 1)


def test_recompute_per_stage_values() -> None:
    assert recompute_per_stage("always", traits("1f1b"), 2, 4, 1) == ("always", "always")
    assert recompute_per_stage(["never", "always"], traits("1f1b"), 2, 4, 1) == ("never", "always")
    assert recompute_per_stage("auto", traits("1f1b"), 4, 8, 1) == ("always",) * 3 + ("never",)
    assert recompute_per_stage("auto", traits("interleaved_1f1b"), 2, 4, 2)[-1] == "never"
    with pytest.raises(ValueError, match="one per stage"):
        recompute_per_stage(["never"], traits("1f1b"), 2, 4, 1)


def test_bad_values_are_refused_before_training() -> None:
    from lightning_pipe import PipelineStrategy

    for bad in ({"offload": -1}, {"offload": "sometimes"}, {"offload": [1, "x"]}, {"recompute": ["never", "x"]}):
        with pytest.raises(ValueError, match="Valid|Give False"):
            PipelineStrategy(**bad)
    # the planner chooses each stage's recompute mode and offload with the split: a value per stage is its to give
    assert PipelineStrategy(recompute=["always", "never"], offload=[0, None], plan="auto").config.offload == [0, None]
    with pytest.raises(ValueError, match="measured balance prices one recompute mode"):
        PipelineStrategy(recompute=["never", "always"], balance="time")
    with pytest.raises(ValueError, match="offload cannot share"):
        PipelineStrategy(schedule="pipemare", offload=True)
    # FSDP2 frees and gathers sharded weights around each micro-batch (found by the conformance matrix: the
    # storage of a sharded parameter could not be read at setup)
    with pytest.raises(ValueError, match="offload's saved-tensor hooks cannot tell them"):
        PipelineStrategy(data_parallel="shard", stages=2, offload=True)


@pytest.mark.gpu
def test_offload_on_a_gpu_copies_through_pinned_memory_on_its_own_stream() -> None:
    weights, inputs, _, kept_peak = _run(None, device="cuda")
    w, i, runner, peak = _run(0, device="cuda")
    torch.cuda.synchronize()
    for a, b in zip(w + i, weights + inputs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert runner.offload is not None and runner.offload.peak_host_bytes > 0 and peak < kept_peak
    assert list(runner.offload._streams) == [torch.device("cuda", 0)]  # the copies ran on their own stream
