"""Block containers (``PipelineStrategy(module="model.blocks")``): the model's own loop over an
``nn.ModuleList`` runs unchanged on every stage; each stage runs only its blocks, on the hidden
state the previous stage sent, with keyword arguments computed on the way."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.config import PipelineConfig
from lightning_pipe.partition.stages.virtual import split_stages
from lightning_pipe.resolve import resolve
from lightning_pipe.runtime.blocks.container import BlockDrive, BlockStage, StageExit
from lightning_pipe.runtime.microbatch import batch_size, signature, split
from lightning_pipe.runtime.pipeline import StagePipeline, StageSplit
from lightning_pipe.runtime.topology import Layout, Placement, Topology
from lightning_pipe.schedules import positions_for


class Block(nn.Module):
    """A transformer-like block: the hidden state first, then keyword arguments from outside."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.attention_type = "full" if index % 2 == 0 else "sliding"

    def forward(self, hidden: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        out = hidden + torch.tanh(self.linear(self.norm(hidden))) * scale
        return out if shift is None else out + shift


class LoopNet(nn.Module):
    """A model whose forward loops over its blocks as Hugging Face models do: an embedding before,
    per-block arguments computed from the input, a final norm and head after."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 6)
        self.blocks = nn.ModuleList([Block(i) for i in range(depth)])
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 2)
        self.seen_types: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        scale = torch.sigmoid(x.sum(-1, keepdim=True))  # computed from the input on every stage
        shifts = {"full": None, "sliding": 0.1 * x.mean(-1, keepdim=True)}
        for block in self.blocks[: len(self.blocks)]:
            self.seen_types.append(block.attention_type)  # an attribute read from every block
            hidden = block(hidden, scale=scale, shift=shifts[block.attention_type])
        return self.head(self.norm(hidden))


def _batch(n: int = 10, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randn(n, 2, generator=g)


def _pipeline(world: Topology, model: LoopNet, schedule: str, chunks: int = 3, **options: Any) -> StagePipeline:
    config = resolve(PipelineConfig(schedule=schedule, chunks=chunks, **options), Layout(1, 1))
    positions = positions_for(config.schedule, 1, config.virtual_stages)
    host, stages = split_stages(model.blocks, [len(model.blocks) // len(positions)] * len(positions), positions, 0)
    model.blocks = host  # type: ignore[assignment]
    placement = Placement(Layout(1, 1), 0, tuple(positions), torch.device("cpu"), "gloo")
    held = {id(p) for p in host.parameters()}
    shared = [p for _, p in sorted(model.named_parameters()) if id(p) not in held]
    return StagePipeline(config, placement, StageSplit(host, stages), world, model, shared)


@pytest.mark.parametrize(
    "schedule, options",
    [
        ("interleaved_1f1b", {}),
        ("interleaved_1f1b", {"recompute": "always"}),
        ("interleaved_zero_bubble", {}),
        ("zbv", {"recompute": "except_last"}),
    ],
)
def test_the_models_own_loop_gives_plain_gradients(world_of_one: Topology, schedule: str, options: dict) -> None:
    model = LoopNet()
    reference = copy.deepcopy(model)
    x, y = _batch()
    F.mse_loss(reference(x), y).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    pipeline = _pipeline(world_of_one, model, schedule, **options)
    micro = split((x, y), pipeline.microbatches_for(batch_size(x)))
    weights = [batch_size(mb) / batch_size(x) for mb in micro]

    def step(i: int) -> torch.Tensor:
        mx, my = micro[i]
        return F.mse_loss(model(mx), my) * weights[i]

    try:
        model.seen_types.clear()
        pipeline.train_step([signature(mb) for mb in micro], step)
        pipeline.hand_over_gradients()
        assert sorted(expected) == sorted(n for n, _ in model.named_parameters())  # names unchanged by the split
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected[name], msg=lambda m, name=name: f"{name}: {m}")
        # the loop read every block's attribute, those of the other stage's blocks included
        assert set(model.seen_types) == {"full", "sliding"}
    finally:
        pipeline.close()


def _host(stage: int, num_stages: int = 2, depth: int = 4) -> tuple[LoopNet, BlockStage]:
    model = LoopNet(depth)
    positions = list(range(num_stages))
    host, _ = split_stages(model.blocks, [depth // num_stages] * num_stages, positions, stage)
    model.blocks = host  # type: ignore[assignment]
    assert isinstance(host, BlockStage)
    return model, host


def test_a_middle_stage_starts_on_the_received_state_and_stops_at_the_next_stages_block() -> None:
    unsplit = LoopNet(6)
    model, host = _host(1, num_stages=3, depth=6)
    assert len(host) == 6 and [n for n, _ in host.named_children()] == ["2", "3"]
    x = torch.randn(4, 3)
    received = torch.randn(4, 6)
    host.hook = BlockDrive(host.bounds, received, stops=True, recompute=False, params=None)
    with pytest.raises(StageExit):
        model(x)
    drive = host.hook
    host.hook = None
    drive.check(is_last=False)
    scale = torch.sigmoid(x.sum(-1, keepdim=True))
    shifts = {"full": None, "sliding": 0.1 * x.mean(-1, keepdim=True)}
    expected = received
    for i in (2, 3):
        block = unsplit.blocks[i]
        expected = block(expected, scale=scale, shift=shifts[block.attention_type])
    torch.testing.assert_close(drive.captured, expected)


def test_a_stage_that_never_reaches_its_blocks_or_runs_them_twice_is_named() -> None:
    model, host = _host(0)
    x = torch.randn(4, 3)
    host.hook = BlockDrive(host.bounds, None, stops=True, recompute=False, params=None)
    with pytest.raises(RuntimeError, match=r"never reached the pipelined blocks 0..1"):
        host.hook.check(is_last=False)
    with pytest.raises(StageExit):
        model(x)
    with pytest.raises(RuntimeError, match="ran the pipelined blocks twice for one micro-batch"):
        model(x)
    host.hook = None
    with pytest.raises(RuntimeError, match=r"block 2 of the pipelined container\) is held by pipeline stage 1 of 2"):
        model(x)
    with pytest.raises(TypeError, match="block container is iterated"):
        host(x)


def test_other_stages_blocks_answer_reads_from_a_meta_copy() -> None:
    """A block another stage holds answers its plain attributes, its modules and its tensors' shapes, dtypes
    and ``requires_grad`` from a copy on the meta device (no memory), in the host's training mode."""
    model = LoopNet(4)
    model.blocks[0].linear.bias.requires_grad_(False)
    host, _ = split_stages(model.blocks, [2, 2], [0, 1], 1)
    assert isinstance(host, BlockStage)
    host.hook = BlockDrive(host.bounds, torch.zeros(1, 6), stops=False, recompute=False, params=None)
    assert host[0].attention_type == "full" and host[1].attention_type == "sliding"
    assert isinstance(host[2].linear, nn.Linear) and host[2].linear.weight.device.type == "cpu"  # held here
    shadow = host[0].linear
    assert type(shadow) is nn.Linear and shadow.weight.is_meta and shadow.weight.shape == (6, 6)
    assert isinstance(shadow.weight, nn.Parameter) and shadow.weight.requires_grad
    assert shadow.bias.is_meta and not shadow.bias.requires_grad  # as frozen before the split
    assert host[0].training and host[0].norm.training
    host.eval()
    assert not host[0].training and not host[0].norm.training and not host[2].training
    host.train()
    assert host[1].norm.training
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        _ = host[0].missing
    assert len(host[1:]) == 3


def test_a_block_called_with_its_hidden_state_as_a_keyword_receives_it() -> None:
    class KeywordNet(LoopNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(x)
            scale = torch.ones(x.shape[0], 1)
            for block in self.blocks:
                hidden = block(hidden=hidden, scale=scale)
            return hidden

    model = KeywordNet()
    unsplit = copy.deepcopy(model)
    positions = [0, 1]
    host, _ = split_stages(model.blocks, [2, 2], positions, 1)
    model.blocks = host  # type: ignore[assignment]
    received = torch.randn(2, 6)
    host.hook = BlockDrive(host.bounds, received, stops=False, recompute=False, params=None)
    out = model(torch.randn(2, 3))
    expected = received
    for i in (2, 3):
        expected = unsplit.blocks[i](hidden=expected, scale=torch.ones(2, 1))
    torch.testing.assert_close(out, expected)


def _torch_encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 4, norm=nn.LayerNorm(8))


@pytest.mark.parametrize("mode", ["train", "eval", "eval_padded"])
def test_torch_encoders_layers_on_two_stages_give_the_unsplit_encoders_output(mode: str) -> None:
    """``nn.TransformerEncoder`` reads ``self.layers[0]`` (its attention's ``batch_first``, its training mode,
    its weights' ``requires_grad``) on every stage: the stage without layer 0 reads them from its meta copy and
    takes the path the unsplit encoder takes. In evaluation with a padding mask that is torch's fast path: the
    hidden state is nested, crosses padded to the input's shape and is nested again; the padding's rows come
    out as the final norm of zeros."""
    encoder = _torch_encoder()
    x = torch.randn(3, 5, 8)
    padding = (torch.arange(5) >= torch.tensor([5, 3, 2]).unsqueeze(1)) if mode != "eval" else None
    stages = []
    for stage in range(2):
        copied = copy.deepcopy(encoder)
        copied.layers, _ = split_stages(copied.layers, [2, 2], [0, 1], stage)  # type: ignore[assignment]
        stages.append(copied.train(mode == "train"))
    encoder.train(mode == "train")
    with torch.set_grad_enabled(mode == "train"):
        expected = encoder(x, src_key_padding_mask=padding)
        first = BlockDrive((0, 2), None, stops=True, recompute=False, params=None)
        with stages[0].layers.routed(first), pytest.raises(StageExit):
            stages[0](x, src_key_padding_mask=padding)
        assert not first.captured.is_nested and first.captured.shape == x.shape  # what crosses
        second = BlockDrive((2, 4), first.captured, stops=False, recompute=False, params=None)
        with stages[1].layers.routed(second):
            out = stages[1](x, src_key_padding_mask=padding)
    torch.testing.assert_close(out, expected)
    if mode == "eval_padded":  # the fast path ran on both stages: the padding's rows are the norm's bias
        assert first.nested_shapes == [(3, 5, 8)] and second.nested_shapes == [(3, 5, 8)]
        assert torch.equal(out[2, 2:], encoder.norm.bias.expand(3, 8))
    else:
        assert first.nested_shapes == [] and second.nested_shapes == []
