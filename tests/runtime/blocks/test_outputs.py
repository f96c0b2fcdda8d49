"""Blocks that hand later blocks more than their hidden state (T5's position biases): what the last
block before a boundary returns for the next crosses under the chain schedules; otherwise refused in
the first micro-batch's forward, naming the block and what it was passed."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe.partition.stages.virtual import split_stages
from lightning_pipe.runtime.blocks.container import BlockDrive, BlockStage, StageExit
from lightning_pipe.runtime.blocks.outputs import BlockOutputs, BlockOutputsRefused
from tests.models import fit_plain
from tests.pipeline import assert_same_weights, fit_pipeline


class BiasBlock(nn.Module):
    """T5's pattern: the first block computes a bias from its own parameter and returns it beside the
    hidden state; every later block takes it and hands it on."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.bias_table = nn.Parameter(torch.randn(6)) if first else None

    def forward(self, hidden: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if bias is None:
            assert self.bias_table is not None
            bias = torch.tanh(self.bias_table)
        return torch.tanh(self.linear(hidden)) + bias, bias


class BiasNet(L.LightningModule):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 6)
        self.blocks = nn.ModuleList([BiasBlock(i == 0) for i in range(depth)])
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, bias = self.embed(x), None
        for block in self.blocks:
            hidden, bias = block(hidden, bias)
        return self.head(hidden)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _stage(stage: int) -> tuple[BiasNet, BlockStage]:
    torch.manual_seed(0)
    model = BiasNet()
    host, _ = split_stages(model.blocks, [2, 2], [0, 1], stage)
    model.blocks = host  # type: ignore[assignment]
    assert isinstance(host, BlockStage)
    return model, host


def test_the_stage_that_made_the_value_refuses_at_the_next_stages_first_block() -> None:
    """Under a schedule that does not carry it (the drive's ``refusal``)."""
    model, host = _stage(0)
    host.hook = BlockDrive(host.bounds, None, stops=True, recompute=False, params=None, refusal="no")
    with pytest.raises(BlockOutputsRefused) as refused:
        model(torch.randn(4, 3))
    message = str(refused.value)
    assert "Block 2 (BiasBlock), the first of the next pipeline stage, is called with 'bias'" in message
    assert "block 0 returned beside its hidden state (output 1 of 2)" in message  # where it was made
    assert "schedules that carry values with their micro-batch (" in message and "nn.Sequential" in message


def test_what_the_last_block_returns_for_the_next_block_crosses_under_a_chain_schedule() -> None:
    model, host = _stage(0)
    drive = BlockDrive(host.bounds, None, stops=True, recompute=False, params=None)
    host.hook = drive
    with pytest.raises(StageExit):
        model(torch.randn(4, 3))
    assert drive.returned_out.codes() == (2, 1) and drive.returned_out.tensors[0].shape == (6,)


def test_a_block_passed_only_its_hidden_state_and_values_from_outside_crosses_as_before() -> None:
    outputs = BlockOutputs()
    mask = torch.ones(3)
    outputs.returned(1, (torch.zeros(2), torch.ones(2)))  # an extra nobody passes on
    outputs.check_boundary(2, "Block", ["hidden", "mask"], (torch.zeros(2), mask), {})
    outputs.check_boundary(2, "Block", ["hidden", "mask"], (), {"hidden": torch.zeros(2), "mask": mask})


def test_a_later_stage_whose_loop_fails_after_another_stages_block_says_why() -> None:
    model, host = _stage(1)
    drive = BlockDrive(host.bounds, torch.zeros(4, 6), stops=False, recompute=False, params=None)
    host.hook = drive
    with pytest.raises(ValueError, match="unpack") as failed:
        model(torch.randn(4, 3))
    assert not drive.entered
    explained = drive.outputs.explain(failed.value)
    assert explained is not None
    assert "failed right after block 0 (BiasBlock), which another pipeline stage holds" in str(explained)
    assert "ValueError: too many values to unpack" in str(explained)


def test_an_error_inside_this_stages_blocks_is_left_as_it_is() -> None:
    outputs = BlockOutputs()
    outputs.skipped = (1, "Block")
    outputs.returned(2, torch.zeros(1))  # this stage's block ran since
    assert outputs.explain(ValueError("x")) is None


def test_such_a_model_trains_as_plain_its_bias_crossing_with_the_micro_batch() -> None:
    """Block 0's bias crosses after the hidden state; the stand-ins on stage 1 return it in the
    block's structure, and its gradient reaches block 0's ``bias_table`` (before: refused)."""
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 3, generator=g), torch.randn(16, 2, generator=g)), batch_size=8)
    torch.manual_seed(0)
    piped = BiasNet()
    reference = copy.deepcopy(piped)
    start = piped.blocks[0].bias_table.detach().clone()
    fit_plain(reference, data)
    fit_pipeline(piped, 2, data, module="blocks")
    assert_same_weights(reference, piped)
    assert not torch.equal(start, piped.blocks[0].bias_table)


def test_a_value_computed_before_the_loop_that_blocks_hand_back_is_not_refused() -> None:
    """A block may return what it was given (a mask, rotary tables): every stage computes it."""
    outputs = BlockOutputs()
    hidden, mask = torch.zeros(2), torch.ones(2)
    outputs.returned(1, (hidden + 1, mask), (hidden, mask), {})
    outputs.check_boundary(2, "Block", ["hidden", "mask"], (hidden, mask), {})
    made = torch.ones(2)
    outputs.returned(1, (hidden + 1, made), (hidden, mask), {})
    with pytest.raises(BlockOutputsRefused, match="called with 'mask'"):
        outputs.check_boundary(2, "Block", ["hidden", "mask"], (hidden, made), {})
