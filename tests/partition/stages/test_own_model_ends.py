"""A model of its own (a character-level GPT, ``module="blocks"``): its embeddings are held by the first stage
only, its final norm and head by the last only, found by tracing one step or named by hand; it trains as plain
training does, and its checkpoints consolidate into the plain class."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import CharGPT, RecordHeld, char_loader, fit_plain
from tests.pipeline import assert_same_weights, fit_pipeline

EMBEDDINGS = {"tok_emb.weight", "pos_emb.weight"}
HEAD = {"ln_f.weight", "ln_f.bias", "head.weight"}


def _parity(folder: Path, devices: int, model: dict[str, Any], **options: Any) -> list[set[str]]:
    """6 SGD steps under the pipeline equal 6 plain steps; each rank's parameter names."""
    torch.manual_seed(0)
    piped = CharGPT(**model)
    reference = copy.deepcopy(piped)
    fit_plain(reference, char_loader())
    fit_pipeline(piped, devices, char_loader(), module="blocks", callbacks=[RecordHeld(str(folder))], **options)
    assert_same_weights(reference, piped)
    return [set(json.loads((folder / f"held{r}.json").read_text())["names"]) for r in range(devices)]


def test_the_embeddings_live_on_the_first_stage_and_the_head_on_the_last(tmp_path: Path) -> None:
    """4 stages under 1F1B: the middle two hold neither (only their blocks), the first no head, the last no
    embedding; the weights equal plain training's."""
    names = _parity(tmp_path, 4, {})
    assert names[0] >= EMBEDDINGS and not HEAD & names[0]
    for middle in names[1:3]:
        assert not (EMBEDDINGS | HEAD) & middle and all(n.startswith("blocks.") for n in middle)
    assert names[3] >= HEAD and not EMBEDDINGS & names[3]


@pytest.mark.slow
@pytest.mark.parametrize(
    "devices, model, options",
    [
        (2, {}, {"schedule": "1f1b"}),
        (2, {"sequential": True}, {"schedule": "interleaved_1f1b"}),
        (4, {"sequential": True}, {"schedule": "1f1b"}),
        (4, {"depth": 8, "tied": True}, {"schedule": "interleaved_1f1b"}),
    ],
    ids=["list-2-1f1b", "sequential-2-interleaved", "sequential-4-1f1b", "tied-4-interleaved"],
)
def test_a_char_gpt_trains_as_plain_with_its_ends_on_the_end_stages(
    tmp_path: Path, devices: int, model: dict, options: dict
) -> None:
    """A ModuleList the forward loops over or an nn.Sequential it calls; a head tied to the token embedding is
    held by the last process as the head's weight (its gradient summed with the first's)."""
    names = _parity(tmp_path, devices, model, **options)
    assert not HEAD & names[0] and not EMBEDDINGS & names[-1]
    if model.get("tied"):
        assert "head.weight" in names[-1] and "tok_emb.weight" in names[0]


@pytest.mark.slow
def test_ends_named_by_hand(tmp_path: Path) -> None:
    """first_stage names the embeddings; last_stage=[] keeps the norm and head on every stage."""
    names = _parity(tmp_path, 2, {}, first_stage=["tok_emb", "pos_emb"], last_stage=[])
    assert names[0] >= EMBEDDINGS and not EMBEDDINGS & names[1] and names[0] >= HEAD and names[1] >= HEAD


@pytest.mark.slow
def test_checkpoints_resume_and_consolidate_into_the_plain_class(tmp_path: Path) -> None:
    """2 pipeline epochs (SGD with momentum, tied head) on 2 stages, saved; resumed on 4 stages for one more, saved;
    consolidated, the plain CharGPT loads it and its weights equal 3 plain epochs (the tie one optimizer entry)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_pipe.checkpoint import consolidate

    data = char_loader(n=16, batch_size=8)  # two steps per epoch
    torch.manual_seed(0)
    initial = CharGPT(tied=True).state_dict()

    def fresh() -> CharGPT:
        module = CharGPT(tied=True)
        module.load_state_dict(initial)
        return module

    plain = fresh()
    fit_plain(plain, data, max_steps=-1, max_epochs=3)
    first, second = tmp_path / "first", tmp_path / "second"
    common = dict(module="blocks", max_steps=-1, enable_checkpointing=True)
    saves = [ModelCheckpoint(dirpath=first, save_last=True, save_top_k=0)]
    fit_pipeline(fresh(), 2, data, max_epochs=2, callbacks=saves, **common)
    saves = [ModelCheckpoint(dirpath=second, save_last=True, save_top_k=0)]
    fit_pipeline(fresh(), 4, data, max_epochs=3, ckpt_path=str(first / "last.ckpt"), callbacks=saves, **common)
    merged = consolidate(second / "last.ckpt", tmp_path / "plain.ckpt")
    assert len(merged["optimizer_states"][0]["state"]) == len(list(plain.parameters()))  # the tie once
    loaded = fresh()
    loaded.load_state_dict(merged["state_dict"])
    assert_same_weights(plain, loaded)
