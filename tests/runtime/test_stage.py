"""A single-stage pipeline runs in-process: the executor and stage runner against plain autograd."""

import copy

import torch
from torch import nn

from lightning_pipe.partition import stage_layers
from lightning_pipe.runtime.executor import Callbacks, Executor
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.stage import StageModule, StageRunner, recomputes
from lightning_pipe.schedules import gpipe, one_f_one_b


def _net(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 2))


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def _run_pipeline(
    seq: nn.Sequential, x: torch.Tensor, y: torch.Tensor, chunks: int, recompute: str, schedule=gpipe
) -> StageModule:
    stage = StageModule(stage_layers(seq, [len(seq)], 0), 0, 1)
    xs, ys = x.chunk(chunks), y.chunk(chunks)

    def step(i: int) -> torch.Tensor:
        out = stage(xs[i])  # what the user's forward does
        return nn.functional.mse_loss(out, ys[i]) * (len(xs[i]) / len(x))

    runner = StageRunner(stage, recompute=recompute)
    executor = Executor(Transport([0], torch.device("cpu")), {0: runner}, rank=0)
    executor.run(schedule(1, len(xs)), [None] * len(xs), Callbacks(step))
    return stage


def test_single_stage_gradients_equal_plain_autograd() -> None:
    x, y = torch.randn(10, 4), torch.randn(10, 2)
    reference = _net()
    nn.functional.mse_loss(reference(x), y).backward()
    for recompute in ("never", "always", "except_last"):
        for schedule in (gpipe, one_f_one_b):
            stage = _run_pipeline(_net(), x, y, chunks=5, recompute=recompute, schedule=schedule)
            for a, b in zip(_grads(stage), _grads(reference)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_recomputation_draws_the_same_dropout_mask() -> None:
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    nets = [_net(0.5) for _ in range(3)]
    torch.manual_seed(1)
    never = _grads(_run_pipeline(nets[0], x, y, chunks=4, recompute="never"))
    torch.manual_seed(1)
    always = _grads(_run_pipeline(nets[1], x, y, chunks=4, recompute="always"))
    for a, b in zip(never, always):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.manual_seed(2)
    other = _grads(_run_pipeline(nets[2], x, y, chunks=4, recompute="never"))
    assert any(not torch.equal(a, b) for a, b in zip(never, other))  # the masks matter


def test_recompute_modes() -> None:
    assert [recomputes("except_last", i, 3) for i in range(3)] == [True, True, False]
    assert all(recomputes("always", i, 3) for i in range(3))
    assert not any(recomputes("never", i, 3) for i in range(3))


def test_recompute_always_keeps_only_stage_inputs() -> None:
    """With recomputation a micro-batch leaves no intermediate activation saved for backward."""
    seq = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    x = torch.randn(6, 16)
    saved: dict[str, int] = {}

    def count(mode: str) -> int:
        stage = StageModule(stage_layers(copy.deepcopy(seq), [4], 0), 0, 1)
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stage.run_layers(x, recompute=(mode == "always")).sum()
        return total

    saved["never"], saved["always"] = count("never"), count("always")
    assert saved["always"] == x.numel()  # the stage input, kept for the recomputation
    assert saved["never"] > 4 * x.numel()  # every layer's input and weight


def test_meter_counts_what_the_schedules_hold() -> None:
    """GPipe holds every micro-batch's activations at once, 1F1B on a single stage one at a time."""
    from lightning_pipe.runtime.activations.meter import SavedActivationMeter

    x, y = torch.randn(8, 4), torch.randn(8, 2)
    peaks = {}
    for schedule in (gpipe, one_f_one_b):
        seq = _net()
        stage = StageModule(stage_layers(seq, [len(seq)], 0), 0, 1)
        xs, ys = x.chunk(4), y.chunk(4)
        runner = StageRunner(stage)
        calls = Callbacks(lambda i, stage=stage, xs=xs, ys=ys: nn.functional.mse_loss(stage(xs[i]), ys[i]))
        runner.meter = SavedActivationMeter(stage.parameters())
        Executor(Transport([0], torch.device("cpu")), {0: runner}, rank=0).run(schedule(1, 4), [None] * 4, calls)
        peaks[schedule.__name__] = runner.meter.peak
        assert runner.meter.current == 0  # everything saved was freed by the backward
    assert peaks["gpipe"] == 4 * peaks["one_f_one_b"] > 0


def _batch_norm_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.BatchNorm1d(8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8, momentum=None),
        nn.Linear(8, 2),
    )


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.clone() for name, b in module.named_buffers()}


def test_recomputation_leaves_batch_norm_statistics_as_the_forward_left_them() -> None:
    """The recomputed forward would update the running statistics a second time: each micro-batch
    must count once, as without recomputation (momentum=None, a cumulative average, included)."""
    x, y = torch.randn(12, 4), torch.randn(12, 2)
    for schedule in (gpipe, one_f_one_b):
        never = _run_pipeline(_batch_norm_net(), x, y, chunks=3, recompute="never", schedule=schedule)
        for mode in ("always", "except_last"):
            recomputed = _run_pipeline(_batch_norm_net(), x, y, chunks=3, recompute=mode, schedule=schedule)
            assert int(recomputed.get_submodule("1").num_batches_tracked) == 3
            for name, value in _buffers(never).items():
                torch.testing.assert_close(_buffers(recomputed)[name], value, rtol=0, atol=0, msg=f"{mode}: {name}")
            for a, b in zip(_grads(recomputed), _grads(never)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    reference = _batch_norm_net()  # one micro-batch per batch: the same as plain training
    nn.functional.mse_loss(reference(x), y).backward()
    single = _run_pipeline(_batch_norm_net(), x, y, chunks=1, recompute="always")
    for name, value in _buffers(reference).items():
        torch.testing.assert_close(_buffers(single)[name], value, msg=name)
    for a, b in zip(_grads(single), _grads(reference)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
