"""What a stage carries for the values a model records of its blocks (router logits, hidden states,
attention weights): its blocks' recorded values after the hidden state, with those received for
earlier blocks, and back into the model's recording."""

import pytest
import torch

from lightning_pipe.runtime.crossing.carried import (
    CARRIED_KEYS,
    CARRYING_SCHEDULES,
    Carry,
    carrying_refusal,
    carrying_refused,
    crossing_line,
    entry_code,
    entry_slots,
)
from lightning_pipe.schedules import TRAITS, traits


def test_an_entry_code_says_how_many_entries_and_which_are_tensors() -> None:
    t = torch.zeros(1)
    assert entry_code([]) == 1 and entry_slots(1) == []
    assert entry_code([t, t]) == 0b111 and entry_slots(0b111) == [True, True]
    assert entry_code([None, t]) == 0b110 and entry_slots(0b110) == [False, True]
    many = [t] * 40  # a 40-entry recording fits one header integer
    assert entry_slots(entry_code(many)) == [True] * 40


def test_a_stage_sends_on_what_it_received_then_what_its_blocks_recorded() -> None:
    assert CARRIED_KEYS == ("hidden_states", "attentions", "cross_attentions", "router_logits")
    received = [{"hidden_states": [None, torch.zeros(2, 3)], "router_logits": [torch.zeros(4, 2)]}, {}]
    carry = Carry(2, received)
    carry.own = {2: {"router_logits": [torch.ones(4, 2)]}, 3: {"hidden_states": [torch.full((2, 3), 2.0)]}}
    carry.recording = True
    hidden = [torch.zeros(2, 3)]
    tensors, codes = carry.outgoing(hidden, 4)
    # per block, per key: block 0 (two hidden-state entries, the first None; one router logit), block 1
    # (nothing), block 2 (a router logit), block 3 (a hidden state)
    assert codes == (0b110, 1, 1, 0b11, 1, 1, 1, 1, 1, 1, 1, 0b11, 0b11, 1, 1, 1)
    assert len(tensors) == 5 and tensors[0] is hidden[0] and tensors[1] is received[0]["hidden_states"][1]
    assert tensors[2] is received[0]["router_logits"][0] and tensors[4] is carry.own[3]["hidden_states"][0]
    # the next stage splits them back by the same codes, the None entries in place
    got_hidden, per_block = Carry.split(tensors, codes)
    assert got_hidden == hidden and per_block is not None and len(per_block) == 4
    assert per_block[0]["hidden_states"][0] is None and per_block[0]["hidden_states"][1] is tensors[1]
    assert per_block[1] == {"hidden_states": [], "attentions": [], "cross_attentions": [], "router_logits": []}
    assert per_block[2]["router_logits"][0] is tensors[3] and per_block[3]["hidden_states"][0] is tensors[4]
    assert carry.keys() == ["hidden_states", "router_logits"]


def test_nothing_is_carried_where_the_model_does_not_record() -> None:
    hidden = [torch.zeros(2, 3)]
    assert Carry(0, None).outgoing(hidden, 2) == (hidden, ())
    assert Carry.split(hidden, ()) == (hidden, None)


def test_outside_a_recording_a_stand_in_feeds_nothing() -> None:
    carry = Carry(1, [{"router_logits": [torch.zeros(4, 2)]}])
    assert not carry.feed(0)  # no Hugging Face collector is active


def test_every_built_in_schedule_carries_recorded_values_and_a_schedule_text_refuses_them() -> None:
    # the chain schedules and Chimera's two directions as plain training, the asynchronous rules as their
    # references (tests/runtime/blocks/test_block_reads.py); a schedule given as text was never run with them
    assert set(TRAITS) == CARRYING_SCHEDULES
    assert all(carrying_refusal(t) is None for t in TRAITS.values())
    refusal = carrying_refusal(traits("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n"))
    assert refusal is not None and "schedule text 'text' does not carry them yet" in refusal
    assert "1f1b" in refusal and "pipemare" in refusal  # names what does


def test_a_refusal_names_each_recording_and_the_setting_that_turns_it_off() -> None:
    message = carrying_refused(["hidden_states", "router_logits"], "the reason", "block 0 runs elsewhere")
    assert "hidden states of every block (output_hidden_states=True)" in message
    assert "router logits of every block for its MoE load-balancing loss" in message
    assert "block 0 runs elsewhere" in message and ": the reason." in message
    assert "output_hidden_states=False and output_router_logits=False" in message


def test_the_bytes_a_stage_sends_for_mixtral_style_router_logits_at_32_layers_and_8_experts() -> None:
    """What docs/models.md quotes: stage 0 of 2 of a 32-layer, 8-expert Mixtral (bf16), for a
    micro-batch of 4096 tokens, sends beside its hidden state its 16 blocks' router logits, one
    (tokens, experts) tensor each: 16 x 4096 x 8 x 2 bytes = 1 MiB. Measured on the tensors the
    stage hands the transport (a narrow model: the router logits' size does not depend on the width)."""
    transformers = pytest.importorskip("transformers")
    from lightning_pipe.partition.stages.virtual import split_stages
    from lightning_pipe.runtime.stage import StageRunner

    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=32,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=8,
                                        num_experts_per_tok=2, max_position_embeddings=64,
                                        output_router_logits=True)  # fmt: skip
    model = transformers.MixtralForCausalLM(config).to(torch.bfloat16)
    host, _ = split_stages(model.model.layers, [16, 16], [0, 1], 0)
    model.model.layers = host
    ids = torch.randint(0, 32, (64, 64))  # 4096 tokens
    runner = StageRunner(host)
    with torch.no_grad():
        sent = runner.forward(0, 1, None, lambda _: model(input_ids=ids, labels=ids, use_cache=False).loss)
    assert sent is not None
    tensors, packing = sent
    codes = packing.recorded
    hidden, carried = tensors[0], tensors[1:]
    assert hidden.shape == (64, 64, 16) and len(carried) == 16
    assert all(t.shape == (4096, 8) and t.dtype == torch.bfloat16 for t in carried)
    assert sum(t.numel() * t.element_size() for t in carried) == 16 * 4096 * 8 * 2 == 1 << 20
    # the header: one integer per block and recorded key (4 keys), whatever the micro-batch's size
    assert len(codes) == 16 * len(CARRIED_KEYS)
    line = crossing_line(0, tensors, codes)
    assert "router_logits (16 tensors), 1048576 bytes" in line and "blocks 0..15" in line


def test_what_the_last_block_returns_for_the_next_crosses_in_its_structure() -> None:
    """T5's ``hidden, position_bias, cross_bias = block(...)``: what the next block is called with
    crosses; the stand-ins on the next stage return the block's structure."""
    from lightning_pipe.runtime.crossing.carried import Returned, split_codes

    hidden, bias, mask = torch.zeros(2, 3), torch.ones(1, 2, 3, 3), torch.zeros(1, 1, 3, 3)
    output = (hidden, bias, None)
    crossing = Returned.of(output, (hidden, mask, bias), {})  # the mask was computed before the loop: stays
    assert crossing.tensors == [bias] and crossing.codes() == (3, 1)
    assert Returned.of(hidden, (hidden,), {}).codes() == ()  # a block that returns its hidden state alone
    codes = (1,) * 2 * len(CARRIED_KEYS) + crossing.codes()  # 2 earlier blocks, nothing recorded
    blocks, shape = split_codes(codes, 2)
    assert blocks == (1,) * 8 and shape == (3, 1)
    received = Returned.received(shape, [bias])
    standing = received.standing_in(hidden)
    assert standing[0] is hidden and standing[1] is bias and standing[2] is None
    assert Returned().standing_in(hidden) is hidden
    line = crossing.line(0, 2)
    assert (
        "stage 0 sends on" in line and "what block 1 returns for block 2: outputs 1 of 3 (1 tensor), 72 bytes" in line
    )
