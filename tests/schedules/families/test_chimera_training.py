"""Chimera: two pipelines in opposite directions over the same processes train like plain training,
keep both copies of every stage equal, evaluate, checkpoint each stage once and resume under
another layout."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe.checkpoint import is_pipeline_checkpoint
from lightning_pipe.checkpoint import main as consolidate_main
from lightning_pipe.runtime.grads.replica_grads import ReplicaReducer
from tests.models import (
    DeferredNet,
    LifecycleNet,
    SaveStageState,
    TiedNet,
    TinyNet,
    WrappedNet,
    fit_plain,
    loader,
    merged_stage_states,
    plain_trainer,
    token_loader,
)
from tests.pipeline import assert_same_weights, fit_pipeline, pipeline_trainer, twins

EPOCH = {"max_steps": -1}


@pytest.mark.parametrize(
    "stages, chunks, recompute",
    [
        (2, 2, "never"),
        (2, 4, "always"),
        (4, 4, "always"),
        (4, 8, "never"),
    ],
)
def test_weights_equal_plain_training(stages: int, chunks: int, recompute: str) -> None:
    """Six SGD-momentum steps (the models' default), chunks = D and 2D."""
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=2 * stages))  # a Linear on every stage
    fit_plain(reference)
    fit_pipeline(piped, stages, schedule="chimera", chunks=chunks, recompute=recompute)
    assert_same_weights(reference, piped)


@pytest.mark.parametrize("stages", [2, 4])
def test_one_micro_batch_leaves_the_up_pipeline_empty_and_still_trains_as_plain(stages: int) -> None:
    """One micro-batch (``chunks=1``, or an epoch's last batch of one sample) goes down only: the up
    copies get no gradient of their own, add zeros to their pair's sum and take the down copy's.
    Before, the pair's buckets differed (the empty copy's parameters were left out) and gloo aborted."""
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=2 * stages))
    fit_plain(reference, loader(48, 12), max_steps=3)
    fit_pipeline(piped, stages, data=loader(48, 12), schedule="chimera", chunks=1, max_steps=3)
    assert_same_weights(reference, piped)


def test_both_copies_of_every_stage_stay_equal(tmp_path: Path) -> None:
    """Each process saves its own module (both of its stages) after training: the two processes
    holding a stage hold equal weights, and those equal plain training's."""
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=8))
    fit_plain(reference)
    fit_pipeline(piped, 4, schedule="chimera", chunks=4, callbacks=[SaveStageState(str(tmp_path))])
    states = [torch.load(tmp_path / f"end-rank{r}.pt") for r in range(4)]
    expected = reference.state_dict()
    for r in range(4):
        assert set(states[r]) == set(states[3 - r])  # the pair holds the same two stages
        for name, value in states[r].items():
            torch.testing.assert_close(value, states[3 - r][name], rtol=0, atol=0)
            torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6)


class _CopyBuckets(L.Callback):
    """Buckets of about one layer for the pair's sums, and a record of when each step sent them."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        gradients = trainer.strategy.pipeline.gradients
        gradients.close()
        group, params, _ = gradients.copies
        gradients.reducer = ReplicaReducer(params, group, 200, mean=False)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        history = trainer.strategy.pipeline.gradients.reducer.history
        (Path(self.folder) / f"buckets{trainer.global_rank}.json").write_text(json.dumps(history))


def test_copies_are_summed_while_the_backward_runs(tmp_path: Path) -> None:
    """From the second step on, every bucket of the pair's sum starts inside the backward, each copy
    counting its own pipeline's micro-batches; the weights still equal plain training's."""
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=8))
    fit_plain(reference)
    fit_pipeline(piped, 4, schedule="chimera", chunks=8, callbacks=[_CopyBuckets(str(tmp_path))])
    assert_same_weights(reference, piped)
    for rank in range(4):
        history = json.loads((tmp_path / f"buckets{rank}.json").read_text())
        assert len(history) == 6 and history[0][0] == 0  # the first step counts the accumulations
        assert all(early == total and total >= 2 for early, total in history[1:]), (rank, history)


def test_a_model_built_on_the_meta_device_starts_both_copies_as_any_layout_does(tmp_path: Path) -> None:
    """Layers created in configure_model are initialised per layer from the run's seed, so both
    copies of a stage (on two processes) start equal to each other and to 1F1B's single copy."""
    for schedule in ("1f1b", "chimera"):
        folder = tmp_path / schedule
        folder.mkdir()
        torch.manual_seed(0)
        fit_pipeline(
            DeferredNet(),
            4,
            schedule=schedule,
            chunks=4,
            max_steps=1,
            callbacks=[SaveStageState(str(folder), start=True)],
        )
    single = merged_stage_states(str(tmp_path / "1f1b"), 4, start=True)
    copies = [torch.load(tmp_path / "chimera" / f"start-rank{r}.pt") for r in range(4)]
    one = [torch.load(tmp_path / "1f1b" / f"start-rank{r}.pt") for r in range(4)]
    for r in range(4):
        assert set(copies[r]) == set(copies[3 - r]) == set(one[r]) | set(one[3 - r])  # both stages materialised
        for name, value in copies[r].items():
            torch.testing.assert_close(value, single[name], rtol=0, atol=0)


@pytest.mark.parametrize("stages", [2, 4])
def test_parameters_outside_the_sequential_and_tied_weights(stages: int) -> None:
    torch.manual_seed(0)
    reference, piped = twins(WrappedNet())
    fit_plain(reference)
    fit_pipeline(piped, stages, schedule="chimera", chunks=stages, recompute="except_last")
    assert_same_weights(reference, piped)
    # TiedNet ties its first and last layer (on processes 0 and D-1, each of which holds both copies)
    reference, piped = twins(TiedNet())
    fit_plain(reference, token_loader(), gradient_clip_val=0.5)
    balance = [2, 3] if stages == 2 else [1, 1, 2, 1]
    fit_pipeline(
        piped, stages, token_loader(), schedule="chimera", chunks=2 * stages, gradient_clip_val=0.5, balance=balance
    )
    assert_same_weights(reference, piped)


def test_evaluate_predict_checkpoint_once_and_resume_under_another_layout(tmp_path: Path) -> None:
    torch.manual_seed(0)
    initial = LifecycleNet().state_dict()
    plain_model = LifecycleNet()
    plain_model.load_state_dict(initial)
    val = loader(n=20, batch_size=8, seed=5)
    plain = fit_plain(plain_model, val_data=val, max_epochs=2, **EPOCH)

    piped = LifecycleNet()
    piped.load_state_dict(initial)
    trainer = fit_pipeline(
        piped, 2, val_data=val, schedule="chimera", chunks=4, max_epochs=2, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)], **EPOCH,
    )  # fmt: skip
    assert_same_weights(plain_model, piped)
    for key in ("val_loss", "train_loss"):
        assert float(trainer.callback_metrics[key]) == pytest.approx(float(plain.callback_metrics[key]), rel=1e-5), key
    last = tmp_path / "last.ckpt"
    assert is_pipeline_checkpoint(last)
    # each stage written once, by its down pipeline's process: the shards hold disjoint names
    shards = [torch.load(last / f"stage-{r:05d}.pt", weights_only=False) for r in range(2)]
    names = [set(shard["state_dict"]) for shard in shards]
    assert names[0] and names[1] and not names[0] & names[1]
    assert names[0] | names[1] == set(initial)

    # resumes under 1F1B and under Chimera, as plain training goes on
    three = LifecycleNet()
    three.load_state_dict(initial)
    fit_plain(three, max_epochs=3, **EPOCH)
    for options in ({"schedule": "1f1b", "chunks": 3}, {"schedule": "chimera", "chunks": 2}):
        resumed = LifecycleNet()
        fit_pipeline(resumed, 2, ckpt_path=str(last), max_epochs=3, **options, **EPOCH)
        assert_same_weights(three, resumed)

    plain_file = tmp_path / "plain.ckpt"
    consolidate_main([str(last), str(plain_file)])
    assert_same_weights(plain_model, LifecycleNet.load_from_checkpoint(plain_file, weights_only=True))

    expected = torch.cat(plain_trainer().predict(three, loader(batch_size=12)))
    predictions = pipeline_trainer(2, schedule="chimera", chunks=4).predict(resumed, loader(batch_size=12))
    assert predictions is not None and len(predictions) == 6
    torch.testing.assert_close(torch.cat(predictions), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("writer", ["1f1b", "chimera"])
def test_tied_weights_resume_across_layouts(tmp_path: Path, writer: str) -> None:
    """A tied weight's copy on the last stage keeps its optimizer state in a Chimera checkpoint too
    (written under that stage's name, as 1F1B writes it), so 1F1B and Chimera resume from either."""
    torch.manual_seed(0)
    initial = TiedNet().state_dict()
    two = TiedNet()
    two.load_state_dict(initial)
    fit_plain(two, token_loader(), max_epochs=2, **EPOCH)
    piped = TiedNet()
    piped.load_state_dict(initial)
    fit_pipeline(
        piped, 2, token_loader(), schedule=writer, chunks=4, max_epochs=1, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)], **EPOCH,
    )  # fmt: skip
    for options in ({"schedule": "1f1b", "chunks": 3}, {"schedule": "chimera", "chunks": 2}):
        resumed = TiedNet()
        fit_pipeline(
            resumed,
            2,
            token_loader(),
            ckpt_path=str(tmp_path / "last.ckpt"),
            max_epochs=2,
            balance=[2, 3],
            **options,
            **EPOCH,
        )
        assert_same_weights(two, resumed)
    # consolidated, the optimizer holds the tied tensor once, as plain training's does
    consolidate_main([str(tmp_path / "last.ckpt"), str(tmp_path / "plain.ckpt")])
    saved = torch.load(tmp_path / "plain.ckpt", weights_only=False)
    assert [len(g["params"]) for g in saved["optimizer_states"][0]["param_groups"]] == [
        len(list(TiedNet().parameters()))
    ]


def test_balance_in_every_mode() -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=8))
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule="chimera", chunks=4, balance="parameters")
    assert_same_weights(reference, piped)
    for balance in ("time", "memory"):  # measured before the split, into 2 stages kept twice
        piped = TinyNet(depth=8)
        piped.load_state_dict(reference.state_dict())
        fit_plain(reference)
        fit_pipeline(piped, 2, schedule="chimera", chunks=4, balance=balance)
        assert_same_weights(reference, piped)


def test_accumulation_clipping_uneven_units_and_evaluation_on_four_processes() -> None:
    """chunks=6 on 4 processes: a unit of 4 and a short one of 2; validation through the up pipeline."""
    torch.manual_seed(0)
    reference, piped = twins(LifecycleNet())
    fit_plain(reference, accumulate_grad_batches=2, gradient_clip_val=0.3)
    fit_pipeline(piped, 4, schedule="chimera", chunks=6, accumulate_grad_batches=2, gradient_clip_val=0.3)
    assert_same_weights(reference, piped)
    val = loader(n=20, batch_size=8, seed=5)
    piped_val = pipeline_trainer(4, schedule="chimera", chunks=4).validate(piped, val, verbose=False)
    plain_val = plain_trainer().validate(reference, val, verbose=False)
    assert piped_val[0]["val_loss"] == pytest.approx(plain_val[0]["val_loss"], rel=1e-5)


@pytest.mark.parametrize(
    "devices, options, match",
    [
        (3, {}, "even number of pipeline stages"),
        (4, {"stages": 2}, "does not combine with data-parallel replicas"),
    ],
)
def test_layouts_chimera_cannot_run_are_refused(devices: int, options: dict, match: str) -> None:
    with pytest.raises(Exception, match=match):  # raised in the processes, as Lightning reports it
        fit_pipeline(TinyNet(depth=8), devices, schedule="chimera", chunks=4, **options)
