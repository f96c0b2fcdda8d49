"""What a stage carries for the MoE load-balancing loss: its blocks' recorded router logits after the
hidden state, with those received for earlier blocks, and back into the model's recording."""

import torch

from lightning_pipe.runtime.carried import CARRYING_SCHEDULES, Carry, carrying_refusal
from lightning_pipe.schedules import ASYNC_SCHEDULES, TRAITS


def test_received_tensors_split_into_the_hidden_state_and_each_earlier_blocks_values() -> None:
    hidden = [torch.zeros(2, 3), torch.ones(2)]
    logits = [torch.full((4, 2), float(i)) for i in range(3)]
    tensors = [*hidden, *logits]
    got_hidden, per_block = Carry.split(tensors, (1, 0, 2))  # block 1 records nothing (a dense block)
    assert got_hidden == hidden and per_block is not None
    assert [len(v) for v in per_block] == [1, 0, 2]
    assert per_block[0][0] is logits[0] and per_block[2][1] is logits[2]
    assert Carry.split(tensors, ()) == (tensors, None)  # nothing carried: all of it is the hidden state


def test_a_stage_sends_on_what_it_received_then_what_its_blocks_recorded() -> None:
    received = [[torch.zeros(4, 2)], []]
    carry = Carry(2, received)
    carry.own = {2: [torch.ones(4, 2)], 3: [torch.full((4, 2), 2.0)]}
    carry.recording = True
    hidden = [torch.zeros(2, 3)]
    tensors, counts = carry.outgoing(hidden, 4)
    assert counts == (1, 0, 1, 1)
    assert tensors[0] is hidden[0] and tensors[1] is received[0][0]
    assert tensors[2] is carry.own[2][0] and tensors[3] is carry.own[3][0]
    # the next stage splits them back by the same counts
    _, per_block = Carry.split(tensors, counts)
    assert per_block is not None and per_block[3][0] is carry.own[3][0]


def test_nothing_is_carried_where_the_model_does_not_record() -> None:
    hidden = [torch.zeros(2, 3)]
    assert Carry(0, None).outgoing(hidden, 2) == (hidden, ())


def test_outside_a_recording_a_stand_in_feeds_nothing() -> None:
    carry = Carry(1, [[torch.zeros(4, 2)]])
    assert not carry.feed(0)  # no Hugging Face collector is active


def test_only_the_chain_schedules_carry_router_logits() -> None:
    # every other schedule runs copies of the stages (Chimera) or stashed weight versions
    assert set(TRAITS) - CARRYING_SCHEDULES == {"chimera", *ASYNC_SCHEDULES}
    for schedule in TRAITS:
        refusal = carrying_refusal(schedule)
        if schedule in CARRYING_SCHEDULES:
            assert refusal is None
        else:  # chimera and the asynchronous schedules
            assert refusal is not None and f"schedule={schedule!r} does not carry them yet" in refusal
            assert "1f1b" in refusal  # names what does
