"""Optimizer states keyed by parameter name, and the consolidated state in the unsplit module's
order whatever stages a process holds (interleaved and V schedules hold non-adjacent ones)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe.checkpoint import consolidate, merge_orders, plain_state_by_name, tie_aliases
from tests.models import TiedNet, TinyNet, fit_plain, loader, token_loader
from tests.pipeline import assert_same_weights, fit_pipeline

pytestmark = pytest.mark.timeout(240)


def _names(*layers: int) -> list[str]:
    return [f"layers.{i}.{kind}" for i in layers for kind in ("weight", "bias")]


@pytest.mark.parametrize(
    "lists",
    [
        [_names(0, 2), _names(4, 6, 7)],  # one stage per process
        [_names(0, 4), _names(2, 6, 7)],  # interleaved, v=2: stages 0 and 2, 1 and 3
        [_names(0, 6, 7), _names(2, 4)],  # ZB-V: stages 0 and 3, 1 and 2
        [_names(10, 11), _names(2, 9)],  # layer 10 after layer 9, not after layer 1
    ],
)
def test_merged_order_is_the_unsplit_modules(lists: list[list[str]]) -> None:
    assert merge_orders(lists) == sorted(
        (n for part in lists for n in part), key=lambda n: (int(n.split(".")[1]), n[-4:] == "bias")
    )


def test_named_layers_merge_in_their_numbers_order() -> None:
    """A Sequential built from an ``OrderedDict`` (torchvision's ``encoder_layer_<i>``) under an
    interleaved schedule: layer 10 after layer 9, not after layer 1."""
    named = lambda *layers: [f"layers.encoder_layer_{i}.{k}" for i in layers for k in ("weight", "bias")]  # noqa: E731
    assert merge_orders([named(0, 1, 10, 11), named(2, 3, 8, 9)]) == named(0, 1, 2, 3, 8, 9, 10, 11)


def test_parameters_outside_the_sequential_stay_around_it() -> None:
    lists = [["embed.weight", *_names(0, 3), "head.weight"], ["embed.weight", *_names(1, 2), "head.weight"]]
    assert merge_orders(lists) == ["embed.weight", *_names(0, 1, 2, 3), "head.weight"]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev"])
def test_plain_lightning_resumes_a_consolidated_checkpoint_exactly(tmp_path: Path, schedule: str) -> None:
    """2 pipeline steps (Adam), consolidated, then 2 plain steps == 4 plain steps: the Adam moments
    of every layer land on that layer."""
    data = loader(n=24, batch_size=12)  # two steps per epoch
    torch.manual_seed(0)
    initial = TinyNet(optimizer="adam", lr=0.01).state_dict()
    four = TinyNet(optimizer="adam", lr=0.01)
    four.load_state_dict(initial)
    fit_plain(four, data, max_steps=-1, max_epochs=2)

    piped = TinyNet(optimizer="adam", lr=0.01)
    piped.load_state_dict(initial)
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit_pipeline(
        piped,
        2,
        data,
        schedule=schedule,
        chunks=4,
        max_steps=-1,
        max_epochs=1,
        enable_checkpointing=True,
        callbacks=[saves],
    )
    plain_file = tmp_path / "plain.ckpt"
    whole = consolidate(tmp_path / "last.ckpt", plain_file)
    # the unsplit module's own order of names, as its state_dict() and torch.save of it give them, whichever
    # process held which stage (under the V schedules rank 0 holds the first and the last)
    assert list(whole["state_dict"]) == list(initial)
    resumed = TinyNet(optimizer="adam", lr=0.01)
    fit_plain(resumed, data, ckpt_path=str(plain_file), max_steps=-1, max_epochs=2)
    assert_same_weights(four, resumed)


def test_tied_copies_on_later_stages_are_aliases_of_the_first_name() -> None:
    ties = [{0: "0.weight", 1: "4.weight"}, {1: "2.weight", 3: "9.weight"}]
    assert tie_aliases(ties, 0, "layers.") == {}
    assert tie_aliases(ties, 1, "layers.") == {"layers.4.weight": "layers.0.weight"}
    assert tie_aliases(ties, 3, "m.layers.") == {"m.layers.9.weight": "m.layers.2.weight"}


def test_a_weight_tied_across_processes_is_one_entry_of_the_consolidated_optimizer(tmp_path: Path) -> None:
    data = token_loader(n=24)  # two steps per epoch
    torch.manual_seed(0)
    initial = TiedNet().state_dict()
    four = TiedNet()
    four.load_state_dict(initial)
    fit_plain(four, data, max_steps=-1, max_epochs=2)
    piped = TiedNet()
    piped.load_state_dict(initial)
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit_pipeline(piped, 2, data, chunks=4, max_steps=-1, max_epochs=1, enable_checkpointing=True, callbacks=[saves])
    plain_file = tmp_path / "plain.ckpt"
    consolidated = consolidate(tmp_path / "last.ckpt", plain_file)
    assert consolidated["optimizer_states"][0]["param_groups"][0]["params"] == list(
        range(len(list(TiedNet().parameters())))
    )
    resumed = TiedNet()
    fit_plain(resumed, data, ckpt_path=str(plain_file), max_steps=-1, max_epochs=2)
    assert_same_weights(four, resumed)


def test_a_plain_optimizer_state_is_named_by_the_stages_merged_groups_or_refused() -> None:
    """Positions of the plain model name the stages' parameters in the unsplit order; a tied copy gets its first
    name's state; groups of another size, or a state that does not fit the parameter, are refused."""
    plain = {
        "state": {0: {"exp_avg": torch.ones(2, 3)}, 1: {"exp_avg": torch.ones(2)}, 2: {"exp_avg": torch.zeros(4)}},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.0, "params": [2]}],
    }
    first = {"param_groups": [{"params": ["l.0.weight", "l.0.bias"]}, {"params": ["e.weight"]}]}
    second = {"param_groups": [{"params": []}, {"params": ["l.1.weight"]}], "aliases": {"l.1.weight": "e.weight"}}
    named = plain_state_by_name(plain, [first, second], {"l.1.weight": (4,)})
    assert named["param_groups"] == [
        {"lr": 0.1, "params": ["l.0.weight", "l.0.bias"]},
        {"lr": 0.0, "params": ["e.weight"]},
    ]
    assert named["state"]["l.1.weight"] is plain["state"][2] and named["state"]["l.0.bias"] is plain["state"][1]
    with pytest.raises(ValueError, match="parameter group 0 holds 2 parameters in the checkpoint, 1 here"):
        plain_state_by_name(plain, [{"param_groups": [{"params": ["l.0.weight"]}, {"params": ["e.weight"]}]}], {})
    with pytest.raises(ValueError, match="the state exp_avg of position 0 does not fit l.0.weight"):
        plain_state_by_name(plain, [first, second], {"l.0.weight": (3, 2)})
