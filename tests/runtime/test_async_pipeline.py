"""Asynchronous schedules (PipeDream, PipeDream-2BW) inside the Trainer loop."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_pipe.schedules import (
    TRAITS,
    closed_form_bubble,
    pipedream,
    pipedream_2bw,
    simulate,
    steady_state_bubble,
    unroll,
    update_delay,
    validate,
    versions_held,
)
from tests.models import EpochLossNet, RecordMetrics, TinyNet, TraceVersions, loader, separable_loader
from tests.pipeline import assert_same_weights, fit_pipeline

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------------------- schedules on paper
@pytest.mark.parametrize("fn", [pipedream, pipedream_2bw])
def test_unrolled_steps_are_valid_and_the_steady_state_has_no_bubble(fn) -> None:
    for p in range(1, 7):
        for m in range(1, 10):
            if fn is pipedream_2bw and m < p - 1:
                continue
            steady = fn(p, m)
            for steps in (1, 2, 5):
                validate(unroll(steady, steps))
            assert steady_state_bubble(steady) == pytest.approx(0.0, abs=1e-12)
            if p > 1:  # a synchronous schedule pays its bubble every batch
                assert closed_form_bubble(p, m) > 0


def test_2bw_needs_enough_microbatches() -> None:
    with pytest.raises(ValueError, match="chunks >= stages - 1"):
        pipedream_2bw(4, 2)
    pipedream(4, 2)  # plain PipeDream stashes more versions instead


def test_versions_and_delays() -> None:
    assert [versions_held("pipedream_2bw", 4, 4, s) for s in range(4)] == [2, 2, 2, 1]
    assert [versions_held("pipedream", 4, 1, s) for s in range(4)] == [4, 3, 2, 1]
    assert [update_delay("pipedream", 4, 1, s) for s in range(4)] == [3, 2, 1, 0]
    assert [update_delay("pipedream_2bw", 4, 4, s) for s in range(4)] == [1, 1, 1, 1]


def test_unrolled_pipeline_amortises_fill_and_drain() -> None:
    short, long = simulate(unroll(pipedream(4, 4), 2)), simulate(unroll(pipedream(4, 4), 8))
    assert long.bubble_fraction < short.bubble_fraction < closed_form_bubble(4, 4)


# ---------------------------------------------------------------------------- the weight versions
@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw"])
@pytest.mark.parametrize("stages", [2, 4])
def test_every_backward_uses_the_version_of_its_forward(tmp_path: Path, schedule: str, stages: int) -> None:
    torch.manual_seed(0)
    fit_pipeline(TinyNet(), stages, schedule=schedule, chunks=3, max_steps=9, callbacks=[TraceVersions(str(tmp_path))])
    stashed = 0
    for rank in range(stages):
        trace = json.loads((tmp_path / f"trace{rank}.json").read_text())["trace"]
        forward_version = {mb: v for kind, mb, v in trace if kind == "F"}
        newest = -1
        backwards = set()
        for kind, mb, version in trace:
            if kind == "F":
                newest = max(newest, version)
                continue
            assert version == forward_version[mb], (rank, mb)  # the gradient reached its own version
            backwards.add(mb)
            stashed += version < newest  # a newer version existed: the stash was needed
        assert backwards == set(forward_version)  # every forward got its backward (drains included)
    assert stashed > 0


# ---------------------------------------------------------------------------- the update rule
def _reference(
    model: torch.nn.Module, batches: list, lr: float, delays: dict[str, int], clip_value: float | None = None
) -> None:
    """Single process: W_s(t+1) = W_s(t) - lr * grad_s f_{t - d_s}(W(t - d_s)); with d = 1 everywhere
    this is PipeDream-2BW's W(t+1) = W(t) - lr * grad f(W(t-1)). ``clip_value``: each applied
    gradient's elements clamped to it."""
    params = dict(model.named_parameters())
    history: list[dict[str, torch.Tensor]] = []
    for t, (x, y) in enumerate(batches):
        loss = F.cross_entropy(model(x), y)
        history.append(dict(zip(params, torch.autograd.grad(loss, list(params.values())))))
        with torch.no_grad():
            for name, p in params.items():
                source = t - delays[name]
                if source >= 0:
                    grad = history[source][name]
                    p -= lr * (grad if clip_value is None else grad.clamp(-clip_value, clip_value))


def _stage_delays(schedule: str, stages: int, chunks: int, model: TinyNet) -> dict[str, int]:
    from lightning_pipe.partition import balance_uniform, stage_bounds

    bounds = stage_bounds(balance_uniform(len(model.layers), stages))
    delays = {}
    for name, _ in model.named_parameters():
        index = int(name.split(".")[1])
        stage = next(s for s, (a, b) in enumerate(bounds) if a <= index < b)
        delays[name] = update_delay(schedule, stages, chunks, stage)
    return delays


@pytest.mark.parametrize(
    "schedule, stages, chunks",
    [("pipedream_2bw", 2, 4), ("pipedream_2bw", 4, 3), ("pipedream", 2, 3), ("pipedream", 4, 2)],
)
def test_weights_follow_the_delayed_update_rule(schedule: str, stages: int, chunks: int) -> None:
    torch.manual_seed(0)
    piped = TinyNet(lr=0.1)
    piped.optimizer = "plain-sgd"
    reference = TinyNet()
    reference.load_state_dict(piped.state_dict())
    steps = 9  # crosses an epoch end (a drain) and its short batch
    batches = [b for _, b in zip(range(steps), iter(_cycle(loader())))]
    _reference(reference, batches, 0.1, _stage_delays(schedule, stages, chunks, reference))
    fit_pipeline(piped, stages, schedule=schedule, chunks=chunks, max_steps=steps)
    assert_same_weights(reference, piped, rtol=1e-4, atol=1e-6)


def test_clipping_by_value_clamps_each_applied_gradient() -> None:
    """gradient_clip_algorithm="value" clips, at each update, the delayed gradient applied then (per
    element, so each stage its own); the first updates, with no gradient due yet, have nothing to clip
    (they raised in torch's clip_grad_value_ before)."""
    torch.manual_seed(0)
    piped = TinyNet(lr=0.1)
    piped.optimizer = "plain-sgd"
    reference, unclipped = TinyNet(), TinyNet()
    reference.load_state_dict(piped.state_dict())
    unclipped.load_state_dict(piped.state_dict())
    batches = [b for _, b in zip(range(5), iter(_cycle(loader())))]
    delays = _stage_delays("pipedream", 2, 2, reference)
    _reference(reference, batches, 0.1, delays, clip_value=0.01)
    _reference(unclipped, batches, 0.1, delays)
    fit_pipeline(piped, 2, schedule="pipedream", chunks=2, max_steps=5, gradient_clip_val=0.01,
                 gradient_clip_algorithm="value")  # fmt: skip
    assert_same_weights(reference, piped, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(unclipped.layers[0].weight, piped.layers[0].weight, atol=1e-4)  # it clipped


ASYNCHRONOUS = [name for name, row in TRAITS.items() if row.asynchronous]


@pytest.mark.parametrize(
    "schedule, predictor", [(name, None) for name in ASYNCHRONOUS] + [("xpipe", "adam"), ("xpipe", "momentum")]
)
def test_saves_and_validations_leave_the_weights_the_rule_gives(
    tmp_path: Path, schedule: str, predictor: str | None
) -> None:
    """A drain never changes the weights the rule gives (a run with more saves or validations trains
    the same): 8 steps over epochs of 6 batches, with a checkpoint after every step and a validation
    every 2 steps, against none. Each save or validation drains the pipeline after the step's update,
    so the next step starts from an empty pipeline, also the last of an epoch, which drains before
    its update in both runs. PipeMare and XPipe run their backwards on the weights of the moment they
    run at, which drains must not move (2 stages: every backward runs at most one update after its
    forward, see docs/schedules.md). Every asynchronous schedule of the traits table is run; XPipe's
    optimizer-state predictors too, with Adam and SGD's momentum; a learning-rate schedule and clipping."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.models import RecordWarnings, ScheduledNet

    optimizer = "adam" if predictor == "adam" else "sgd"
    options: dict = dict(schedule=schedule, chunks=2, max_steps=8, gradient_clip_val=1.0)
    if predictor is not None:
        options["xpipe_predictor"] = predictor
    torch.manual_seed(0)
    plain = ScheduledNet(lr=0.1, optimizer=optimizer)
    drained = ScheduledNet(lr=0.1, optimizer=optimizer)
    drained.load_state_dict(plain.state_dict())
    fit_pipeline(plain, 2, **options)
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)
    callbacks = [saves, RecordWarnings(str(tmp_path))]
    fit_pipeline(drained, 2, val_data=loader(n=12), enable_checkpointing=True, callbacks=callbacks,
                 val_check_interval=2, limit_val_batches=1, **options)  # fmt: skip
    assert (tmp_path / "last.ckpt").exists()
    said = json.loads((tmp_path / "warnings0.json").read_text())
    assert not [w for w in said if "draining the pipeline between steps" in w]  # exact: nothing to tell
    assert_same_weights(plain, drained, rtol=0, atol=1e-7)
    torch.manual_seed(0)
    assert not torch.allclose(ScheduledNet().layers[2].weight, plain.layers[2].weight)  # it trained


@pytest.mark.parametrize("schedule", ["pipemare", "xpipe"])
def test_a_run_stopped_by_max_steps_resumes_to_the_uninterrupted_weights(tmp_path: Path, schedule: str) -> None:
    """PipeMare and XPipe run their backwards on the weights of their moment, so where training stops
    by ``max_steps`` in the middle of an epoch the pipeline drains after the last update, as the run
    going on would have run those backwards in its next step. Epochs of 6 batches: stopped at 5 (the
    pipeline full), resumed and stopped at 7 (its last step from an empty pipeline), resumed to 8,
    against 8 steps at once; before the fix the stops drained before their update (2.3e-6 and 2.4e-5 off)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.models import ScheduledNet

    options: dict = dict(schedule=schedule, chunks=2, gradient_clip_val=1.0)
    torch.manual_seed(0)
    straight = ScheduledNet(lr=0.1)
    stopped = ScheduledNet(lr=0.1)
    stopped.load_state_dict(straight.state_dict())
    fit_pipeline(straight, 2, max_steps=8, **options)
    path = None
    for steps in (5, 7, 8):
        saves = ModelCheckpoint(dirpath=tmp_path / str(steps), save_last=True, save_top_k=0, every_n_train_steps=1)
        fit_pipeline(
            stopped, 2, ckpt_path=path, max_steps=steps, enable_checkpointing=True, callbacks=[saves], **options
        )
        path = str(tmp_path / str(steps) / "last.ckpt")
    assert_same_weights(straight, stopped, rtol=0, atol=1e-7)
    torch.manual_seed(0)
    assert not torch.allclose(ScheduledNet().layers[2].weight, straight.layers[2].weight)  # it trained


def test_a_drain_that_changes_pipemares_weights_is_told_once(tmp_path: Path) -> None:
    """3 stages, 1 chunk: stage 0's backwards trail their forwards by two updates, which a drain in the
    middle of an epoch cannot give them; rank 0 says so once, with what makes drains exact."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.models import RecordWarnings

    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)
    callbacks = [saves, RecordWarnings(str(tmp_path))]
    fit_pipeline(
        TinyNet(), 3, schedule="pipemare", chunks=1, max_steps=3, enable_checkpointing=True, callbacks=callbacks
    )
    said = [json.loads((tmp_path / f"warnings{rank}.json").read_text()) for rank in range(3)]
    told = [[w for w in ws if "draining the pipeline between steps" in w] for ws in said]
    assert [len(t) for t in told] == [1, 0, 0], said
    assert told[0][0].startswith("schedule='pipemare' with 1 micro-batch(es) per batch on 3 stages")
    assert "chunks >= 2 makes every drain exact" in told[0][0]


def _cycle(data):
    while True:
        yield from data


# ---------------------------------------------------------------------------- training works
def test_async_schedules_train_about_as_well_as_1f1b(tmp_path: Path) -> None:
    losses = {}
    for schedule in ("1f1b", "pipedream", "pipedream_2bw"):
        torch.manual_seed(0)
        folder = tmp_path / schedule
        folder.mkdir()
        fit_pipeline(
            EpochLossNet(lr=0.05), 2, separable_loader(), schedule=schedule, chunks=4, max_steps=-1, max_epochs=8,
            callbacks=[RecordMetrics(str(folder))],
        )  # fmt: skip
        losses[schedule] = json.loads((folder / "rank0.json").read_text())["train_loss_epoch"]
    first = 1.1  # about ln(3): where every run starts
    assert losses["1f1b"] < 0.6 * first  # the task is learnt
    for schedule in ("pipedream", "pipedream_2bw"):
        assert abs(losses[schedule] - losses["1f1b"]) <= 0.25 * losses["1f1b"], losses


def test_checkpoint_under_2bw_resumes_exactly(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    initial = TinyNet().state_dict()
    straight = TinyNet()
    straight.load_state_dict(initial)
    fit_pipeline(straight, 2, schedule="pipedream_2bw", chunks=3, max_steps=-1, max_epochs=3)
    first = TinyNet()
    first.load_state_dict(initial)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit_pipeline(
        first,
        2,
        schedule="pipedream_2bw",
        chunks=3,
        max_steps=-1,
        max_epochs=2,
        enable_checkpointing=True,
        callbacks=[ckpt],
    )
    resumed = TinyNet()
    fit_pipeline(
        resumed,
        2,
        ckpt_path=str(tmp_path / "last.ckpt"),
        schedule="pipedream_2bw",
        chunks=3,
        max_steps=-1,
        max_epochs=3,
    )
    assert_same_weights(straight, resumed)


def test_render_reports_weight_versions() -> None:
    from lightning_pipe.schedules import render

    text = render(unroll(pipedream_2bw(2, 3), 3))
    assert text.splitlines()[-1].endswith("weight versions per stage 2, 1")


def test_a_batch_too_short_for_2bw_runs_isolated() -> None:
    from lightning_pipe.schedules.families.asynchronous import isolated_step, min_chunks

    assert [min_chunks("pipedream_2bw", p) for p in (1, 2, 4, 8)] == [1, 1, 3, 7]
    assert min_chunks("pipedream", 8) == 1
    for p in range(2, 7):
        for m in range(1, p - 1):
            validate(unroll(isolated_step(p, m), 1))  # from an empty pipeline, drained at once


class _ReturnedAndLogged(L.Callback):
    """Rank 0: the loss each step returns, and each batch's logged ``train_loss`` in batch order."""

    def __init__(self, folder: str) -> None:
        self.folder, self.returned, self.logged = folder, [], []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        cls, record = type(module), self

        def log(self: L.LightningModule, name: str, value: object, *args: object, **kwargs: object) -> None:
            if name == "train_loss":
                record.logged.append(float(value))  # type: ignore[arg-type]
            cls.log(self, name, value, *args, **kwargs)

        module.__class__ = type(cls.__name__, (cls,), {"log": log})

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self.returned.append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            Path(self.folder, "losses.json").write_text(json.dumps([self.returned, self.logged]))


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw"])
def test_a_step_returns_the_previous_batchs_loss_at_drains_too(tmp_path: Path, schedule: str) -> None:
    """Two epochs of 4 batches (a drain after each): every batch's loss is returned once, in order,
    one step late; the returned values do not skip the batch before a drain nor repeat its last."""
    fit_pipeline(TinyNet(), 2, loader(n=32, batch_size=8), schedule=schedule, chunks=2, max_steps=8,
                 callbacks=[_ReturnedAndLogged(str(tmp_path))])  # fmt: skip
    returned, logged = json.loads((tmp_path / "losses.json").read_text())
    assert len(returned) == len(logged) == 8 and len(set(logged)) == 8
    assert returned[0] != returned[0]  # nan: no batch before the first
    assert returned[1:] == pytest.approx(logged[:-1], rel=1e-6)
