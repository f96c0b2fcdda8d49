"""A block container's model that reads the output of a block another stage runs (blocks' outputs
pooled after the loop, a probe loss on an intermediate block, Hugging Face's recorded hidden
states, attentions and router logits) is refused on the stage that would read wrong values, before
any backward, with gradients or without; a model that reads only the hidden state it passes on runs as
before."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_pipe.partition.stages.virtual import split_stages
from lightning_pipe.runtime.blocks.container import BlockDrive, BlockStage, StageExit
from lightning_pipe.runtime.blocks.reads import HeldBlockRead, HeldOutput, refuse_held

HELD_READ = r"depends on the output of block {}, which another pipeline stage runs: this stage runs only blocks 2..3"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.linear(hidden))


class ReadingNet(nn.Module):
    """A loop over 4 blocks whose loss reads, besides the last block's output, ``reads``: ``"pool"``
    every block's output averaged after the loop, ``"probe"`` block 1's output, ``"skip"`` block 0's
    output added into block 3's input, ``"statistic"`` a detached statistic of block 0's output,
    ``"item"`` the same as a Python number, ``"written"`` block 0's output copied into a buffer,
    ``None`` nothing else."""

    def __init__(self, reads: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 6)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(6, 1)
        self.reads = reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        outputs = []
        for i, block in enumerate(self.blocks):
            if self.reads == "skip" and i == 3:
                hidden = hidden + outputs[0]
            hidden = block(hidden)
            outputs.append(hidden)
        loss = self.head(hidden).pow(2).mean()
        if self.reads == "pool":
            loss = loss + self.head(torch.stack(outputs).mean(0)).pow(2).mean()
        if self.reads == "probe":
            loss = loss + outputs[1].pow(2).mean()
        if self.reads == "statistic":
            loss = loss * outputs[0].detach().std()
        if self.reads == "item":
            loss = loss * outputs[0].abs().mean().item()
        if self.reads == "written":
            buffer = torch.zeros_like(hidden)
            buffer.copy_(outputs[0])
            loss = loss + buffer.mean()
        return loss


def _last_stage(model: nn.Module, path: str, stage: int = 1, num_stages: int = 2) -> BlockStage:
    """Splits the container at ``path`` into ``num_stages`` equal stages and keeps ``stage``'s."""
    parent, _, name = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    blocks = getattr(owner, name)
    n = len(blocks)
    host, _ = split_stages(blocks, [n // num_stages] * num_stages, list(range(num_stages)), stage)
    setattr(owner, name, host)
    assert isinstance(host, BlockStage)
    return host


def _drive(host: BlockStage, received: Any, last: bool = True) -> BlockDrive:
    host.hook = BlockDrive(host.bounds, received, stops=not last, recompute=False, params=None)
    return host.hook


@pytest.mark.parametrize("grad", [True, False], ids=["training", "evaluation"])
@pytest.mark.parametrize("reads, block", [("pool", "[01]"), ("probe", "1"), ("statistic", "0")])
def test_a_loss_on_an_earlier_stages_block_output_is_refused_before_the_backward(
    reads: str, block: str, grad: bool
) -> None:
    """The loss carries where it came from, with gradients or without, detached or not: the stage
    refuses it (``refuse_held``) before any backward."""
    model = ReadingNet(reads)
    host = _last_stage(model, "blocks")
    _drive(host, torch.randn(5, 6, requires_grad=grad))
    with torch.set_grad_enabled(grad):
        loss = model(torch.randn(5, 3))
    assert isinstance(loss, HeldOutput)
    with pytest.raises(HeldBlockRead, match="The step's loss " + HELD_READ.format(block)):
        refuse_held(loss, "The step's loss")


@pytest.mark.parametrize(
    "reads, what",
    [
        ("item", r"reads into Python \(item\) a value that"),
        ("written", r"writes \(copy_\) into another tensor a value that"),
    ],
)
def test_a_read_that_leaves_the_tensor_is_refused_at_once(reads: str, what: str) -> None:
    model = ReadingNet(reads)
    host = _last_stage(model, "blocks")
    _drive(host, torch.randn(5, 6))
    with torch.no_grad(), pytest.raises(HeldBlockRead, match=f"The step {what} " + HELD_READ.format(0)):
        model(torch.randn(5, 3))


def test_a_middle_stage_that_feeds_a_skipped_blocks_output_into_its_blocks_is_refused() -> None:
    """Block 0's output added into block 3's input, on the stage of blocks 2..3: refused when block
    3 is called, before what the stage sends on or its loss exists."""
    model = ReadingNet("skip")
    host = _last_stage(model, "blocks")
    _drive(host, torch.randn(5, 6, requires_grad=True))
    with pytest.raises(HeldBlockRead, match="What block 3 is called with " + HELD_READ.format(0)):
        model(torch.randn(5, 3))


def test_a_model_that_reads_only_the_hidden_state_gets_its_gradients_unchanged() -> None:
    unsplit = ReadingNet(None)
    model = ReadingNet(None)
    host = _last_stage(model, "blocks")
    received = torch.randn(5, 6, requires_grad=True)
    _drive(host, received)
    x = torch.randn(5, 3)
    loss = model(x)
    assert type(loss) is torch.Tensor
    loss.backward()
    hidden = received.detach().requires_grad_(True)
    out = hidden
    for i in (2, 3):
        out = unsplit.blocks[i](out)
    unsplit.head(out).pow(2).mean().backward()
    torch.testing.assert_close(received.grad, hidden.grad)
    for i in (2, 3):
        torch.testing.assert_close(model.blocks[i].linear.weight.grad, unsplit.blocks[i].linear.weight.grad)


transformers = pytest.importorskip("transformers")


def _bert() -> nn.Module:
    config = transformers.BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=32, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return transformers.BertModel(config)


def _mixtral(router_logits: bool) -> nn.Module:
    config = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32,
                                        output_router_logits=router_logits)  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def _qwen2_moe(router_logits: bool) -> nn.Module:
    config = transformers.Qwen2MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                         max_position_embeddings=32, output_router_logits=router_logits)  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config)


@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_hf_outputs_recorded_from_other_stages_blocks_are_refused_at_once(flag: str) -> None:
    model = _bert()
    host = _last_stage(model, "encoder.layer")
    _drive(host, torch.randn(2, 8, 64))
    ids = torch.randint(1, 96, (2, 8))
    words = {"output_hidden_states": "hidden states", "output_attentions": "attention weights"}[flag]
    # they cross stages with the micro-batch; a last stage that received none refuses
    with pytest.raises(
        RuntimeError,
        match=rf"records the {words} of every block .*block 0 runs on another pipeline stage .*not received"
        rf".*{flag}=False",
    ):
        model(input_ids=ids, **{flag: True})
    with torch.no_grad(), pytest.raises(RuntimeError, match=rf"records the {words}"):  # evaluation too
        model(input_ids=ids, **{flag: True})
    model(input_ids=ids)  # without the flag the loop runs


@pytest.mark.parametrize("build", [_mixtral, _qwen2_moe], ids=["mixtral", "qwen2_moe"])
def test_the_moe_load_balancing_loss_over_other_stages_routers_is_refused(build: Any) -> None:
    ids = torch.randint(1, 96, (2, 8))
    model = build(router_logits=True)
    host = _last_stage(model, "model.layers")
    _drive(host, torch.randn(2, 8, 64))
    with pytest.raises(RuntimeError, match=r"router logits .*load-balancing loss.*output_router_logits=False"):
        model(input_ids=ids, labels=ids, use_cache=False)
    host.hook = None
    _drive(host, torch.randn(2, 8, 64))
    model(input_ids=ids, labels=ids, use_cache=False, output_router_logits=False).loss.backward()  # off: runs


def test_the_first_stage_may_record_its_own_blocks_outputs() -> None:
    """Stage 0 of 2 records blocks 0..1 and ends at block 2; nothing it recorded is used."""
    model = _mixtral(router_logits=True)
    host = _last_stage(model, "model.layers", stage=0)
    drive = _drive(host, None, last=False)
    ids = torch.randint(1, 96, (2, 8))
    with pytest.raises(StageExit):
        model(input_ids=ids, labels=ids, use_cache=False)
    drive.check(is_last=False)
