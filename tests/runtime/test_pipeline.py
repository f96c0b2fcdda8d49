"""``StagePipeline`` driven without a Trainer: one process (a gloo world of one) holding both
stages of a split, which hand activations and gradients over in memory."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.config import PipelineConfig
from lightning_pipe.partition.stages.virtual import split_stages
from lightning_pipe.resolve import resolve
from lightning_pipe.runtime.microbatch import batch_size, signature, split
from lightning_pipe.runtime.pipeline import StagePipeline, StageSplit
from lightning_pipe.runtime.topology import Layout, Placement, Topology
from lightning_pipe.schedules import positions_for, stage_positions


class Net(nn.Module):
    """A user's model: a Sequential to split, called once per micro-batch by its step."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(depth)])


def _pipeline(world: Topology, model: Net, schedule: str, chunks: int = 3, **options: Any) -> StagePipeline:
    """``model``'s Sequential split into two stages, both on this process, under a pipeline."""
    config = resolve(PipelineConfig(schedule=schedule, chunks=chunks, **options), Layout(1, 1))
    positions = positions_for(config.schedule, 1, config.virtual_stages)
    host, stages = split_stages(model.layers, [len(model.layers) // len(positions)] * len(positions), positions, 0)
    model.layers = host
    placement = Placement(Layout(1, 1), 0, tuple(positions), torch.device("cpu"), "gloo")
    return StagePipeline(config, placement, StageSplit(host, stages), world, model)


def _batch(n: int = 10, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randn(n, 6, generator=g)


def _train(
    pipeline: StagePipeline, model: Net, batch: tuple[torch.Tensor, torch.Tensor], losses: list | None = None
) -> bool:
    """One batch through ``pipeline`` as a training step would run it: the micro-batch losses
    weighted by their share of the batch."""
    micro = split(batch, pipeline.microbatches_for(batch_size(batch)))
    weights = [batch_size(mb) / batch_size(batch) for mb in micro]

    def step(i: int) -> torch.Tensor:
        x, y = micro[i]
        loss = F.mse_loss(model.layers(x), y)
        if losses is not None:
            losses.append(float(loss))
        return loss * weights[i]

    return pipeline.train_step([signature(mb) for mb in micro], step)


def _plain_grads(model: Net, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(model)
    x, y = batch
    F.mse_loss(reference.layers(x), y).backward()
    return {n: p.grad for n, p in reference.named_parameters()}


@pytest.mark.parametrize(
    "schedule, options",
    [
        ("interleaved_1f1b", {}),
        ("interleaved_1f1b", {"recompute": "always", "gradient_accumulation_fusion": False}),
        ("interleaved_zero_bubble", {}),  # the backward split into B and W
        ("zbv", {"recompute": "except_last"}),
    ],
)
def test_a_training_step_gives_plain_gradients(world_of_one: Topology, schedule: str, options: dict) -> None:
    model = Net()
    expected = _plain_grads(model, _batch())
    pipeline = _pipeline(world_of_one, model, schedule, **options)
    try:
        assert sorted(pipeline.stages) == [0, 1] and pipeline.placement.is_last_stage
        assert _train(pipeline, model, _batch()) is True  # synchronous: nothing stays in flight
        assert all(p.grad is None for p in model.parameters())  # kept aside until handed over
        pipeline.hand_over_gradients()
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected[name], msg=lambda m, name=name: f"{name}: {m}")
    finally:
        pipeline.close()


def test_gradients_survive_a_zero_grad_and_add_to_what_grad_holds(world_of_one: Topology) -> None:
    """Lightning zeroes ``.grad`` between the step and ``backward``; the handed-over gradients
    are scaled (accumulation over batches) and added."""
    model = Net()
    expected = _plain_grads(model, _batch())
    pipeline = _pipeline(world_of_one, model, "interleaved_1f1b")
    try:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        _train(pipeline, model, _batch())
        assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())  # what it held, given back
        for p in model.parameters():
            p.grad = None  # zero_grad(set_to_none=True)
        pipeline.hand_over_gradients(0.5)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, 0.5 * expected[name])
    finally:
        pipeline.close()


def test_evaluation_runs_forward_only_and_a_short_batch_takes_fewer_microbatches(world_of_one: Topology) -> None:
    model = Net()
    reference = copy.deepcopy(model)
    pipeline = _pipeline(world_of_one, model, "interleaved_1f1b", chunks=4)
    try:
        x, _ = _batch(n=3)  # fewer samples than chunks: interleaving rounds down to what it can run
        micro = split(x, pipeline.microbatches_for(batch_size(x)))
        assert len(micro) == 3
        outputs: list[Any] = [None] * len(micro)

        def step(i: int) -> None:
            outputs[i] = model.layers(micro[i])

        with torch.no_grad():
            pipeline.evaluate([signature(mb) for mb in micro], step)
        torch.testing.assert_close(torch.cat(outputs), reference.layers(x))
        assert all(p.grad is None for p in model.parameters())
    finally:
        pipeline.close()


def test_clipping_takes_the_norm_over_the_stage_gradients(world_of_one: Topology) -> None:
    model = Net()
    reference = copy.deepcopy(model)
    x, y = _batch()
    F.mse_loss(reference.layers(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.01)
    pipeline = _pipeline(world_of_one, model, "interleaved_1f1b")
    try:
        _train(pipeline, model, _batch())
        pipeline.hand_over_gradients()
        norm = pipeline.clip_grad_norm_(list(model.parameters()), 0.01)
        torch.testing.assert_close(norm, expected)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
    finally:
        pipeline.close()


def test_the_step_function_reaches_the_runners_for_one_verb_only(world_of_one: Topology) -> None:
    """The step goes down with the verb's call; nothing below keeps it once the verb returns."""
    model = Net()
    pipeline = _pipeline(world_of_one, model, "interleaved_1f1b")
    try:
        x, y = _batch()
        micro = split((x, y), pipeline.microbatches_for(batch_size(x)))

        def step(i: int) -> torch.Tensor:
            return F.mse_loss(model.layers(micro[i][0]), micro[i][1])

        kept = weakref.ref(step)
        pipeline.train_step([signature(mb) for mb in micro], step)
        del step
        gc.collect()
        assert kept() is None
        with pytest.raises(RuntimeError, match="needs the user's step"):  # a runner never keeps a caller's step
            pipeline.runner.forward(0, 1, None)
    finally:
        pipeline.close()


def test_schedules_are_built_once_per_microbatch_count(world_of_one: Topology) -> None:
    model = Net()
    pipeline = _pipeline(world_of_one, model, "interleaved_1f1b")
    try:
        assert pipeline.schedule(2, forward=True) is pipeline.schedule(2, forward=True)
        assert pipeline.schedule(2) is not pipeline.schedule(3)
        assert pipeline.schedule(2, forward=True).forward_only and pipeline.schedule(2).num_stages == 2
    finally:
        pipeline.close()


def test_callers_share_one_timeline_keeping_what_each_needs(world_of_one: Topology) -> None:
    model = Net()
    pipeline = _pipeline(world_of_one, model, "interleaved_1f1b")
    try:
        first = pipeline.enable_timeline(keep=0)
        assert first.keep == 0
        assert pipeline.enable_timeline(keep=3) is first and first.keep == 3
        assert pipeline.enable_timeline() is first and first.keep is None  # someone wants every step
        assert pipeline.enable_timeline(keep=0) is first and first.keep is None
        _train(pipeline, model, _batch())
        names = [span.name for span in first.steps[-1]]
        assert names.count("F") == 2 * 3 and names.count("B") == 2 * 3  # two stages, three micro-batches
    finally:
        pipeline.close()


@pytest.mark.parametrize(
    "schedule, virtual, balance, message",
    [
        ("chimera", 1, [2, 2], "pipeline stages 0 and 1 of 2"),  # the copies run the split's 2 stages
        ("interleaved_1f1b", 2, [1, 1, 1, 1], "pipeline stages 0 and 2 of 4"),
        ("1f1b", 1, [2, 2], "pipeline stage 0 of 2"),
    ],
)
def test_the_module_of_a_process_names_its_stages_as_the_layout_line_counts_them(
    schedule: str, virtual: int, balance: list[int], message: str
) -> None:
    """Called outside the Trainer's steps, the module of process 0 on 2 processes says which stages it holds
    (Chimera's said "stage 0 of 4" while the layout line gives 2 stages)."""
    host, _ = split_stages(Net(depth=4).layers, balance, stage_positions(schedule, 2, virtual), 0)
    with pytest.raises(RuntimeError, match=rf"This module holds {message}; it runs inside the Trainer's steps"):
        host(torch.randn(2, 6))


def test_pipedream_2bw_applies_each_batch_gradient_one_step_late(world_of_one: Topology) -> None:
    """W(t+1) = W(t) - lr * grad f(W(t-1)) on one stage: the gradient handed over at step t is
    batch t-1's, computed on the weights batch t-1's forward used."""
    model = Net(depth=2)
    torch.manual_seed(0)
    lr = 0.1
    config = resolve(PipelineConfig(schedule="pipedream_2bw", chunks=2), Layout(1, 1))
    host, stages = split_stages(model.layers, [2], [0], 0)
    model.layers = host
    placement = Placement(Layout(1, 1), 0, (0,), torch.device("cpu"), "gloo")
    pipeline = StagePipeline(config, placement, StageSplit(host, stages), world_of_one, model)
    batches = [_batch(seed=s) for s in range(4)]
    weights = [copy.deepcopy(model.state_dict())]
    try:
        for batch in batches:
            _train(pipeline, model, batch)
            pipeline.hand_over_gradients()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(lr * p.grad)
                    p.grad = None
            weights.append(copy.deepcopy(model.state_dict()))
        pipeline.drain()
        assert not pipeline.in_flight and pipeline.state_dict() == {"step": 4, "pending": pipeline.asynchronous.pending}
    finally:
        pipeline.close()
    for t in range(len(batches)):  # W(t+1) from W(t) and batch t-1's gradient at W(t-1)
        plain = Net(depth=2)
        if t >= 1:
            plain.load_state_dict(weights[t - 1])
            grads = _plain_grads(plain, batches[t - 1])
        expected = {k: v - lr * grads[k] if t >= 1 else v for k, v in weights[t].items()}
        for name, value in weights[t + 1].items():
            torch.testing.assert_close(value, expected[name], msg=lambda m, t=t, name=name: f"step {t}, {name}: {m}")
