"""Runs one conformance cell and judges it against its oracle.

The oracles: plain one-process Lightning on the same batches for a synchronous schedule; for an
asynchronous one, the same schedule run without the event (a drain, a save, a resume, a placement
must not change its weights), and the rule written out in one process where the cell is a plain chain
(:func:`_delayed_rule`: the stashing rules' delayed update, PipeMare's and XPipe's reference); for an
elastic layout, the uninterrupted run on the first world. A cell the traits refuse must be refused
before its first training step, with the sentence :func:`~tests.conformance.axes.refusal` names.
"""

from __future__ import annotations

import copy
import json
import re
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.conformance.axes import (
    RECORDS_REFUSED,
    TORCH_TEXT,
    Cell,
    Event,
    Layout,
    Model,
    microbatches,
    refusal,
    schedule_argument,
    schedule_traits,
)
from tests.conformance.models import BATCH, build, data, strategy_options
from tests.models import fit_plain, plain_trainer
from tests.pipeline import fit_pipeline
from tests.pipeline import pipeline_trainer as _pipeline_trainer
from tests.runtime.test_async_pipeline import _stage_delays

STEPS, STEPS_PER_EPOCH = 6, 3
#: weights against plain Lightning (float noise of another order of sums); against the same schedule
PLAIN, SAME = {"rtol": 1e-4, "atol": 1e-6}, {"rtol": 1e-6, "atol": 1e-7}


@dataclass(frozen=True)
class Outcome:
    """``status``: "pass", "refused" (as the traits say, before training) or "fail"; ``detail`` says why."""

    cell: str
    status: str
    detail: str

    def __str__(self) -> str:
        return f"{self.cell}: {self.status} ({self.detail})"


class _Started(L.Callback):
    """Leaves ``<folder>/started`` at the first training step of any process, ``<folder>/stepped`` once a
    training step has ended (its update applied)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        (self.folder / "started").touch()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        (self.folder / "stepped").touch()


class _Logged(L.Callback):
    """Writes each rank's logged values (``callback_metrics``) at the end of a fit to ``<folder>/rank<k>.json``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        values = {k: float(v) for k, v in trainer.callback_metrics.items()}
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(values))


def _logged(folder: Path) -> list[dict[str, float]]:
    """Every rank's logged values of the last fit that ran in ``folder``'s cell."""
    return [json.loads(f.read_text()) for f in sorted((folder / "logged").glob("rank*.json"))]


def _fresh_port() -> None:
    """Lightning's launcher leaves its port in MASTER_PORT, and a cell starts several runs: each gets a
    free port, as the tests' ``fresh_main_port`` fixture gives each test one."""
    import os

    from tests.ports import free_port

    os.environ["MASTER_PORT"] = str(free_port())


def pipeline_trainer(devices: int, **options: Any) -> L.Trainer:
    _fresh_port()
    return _pipeline_trainer(devices, **options)


def _initial(model: Model, scheduler: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return build(model, scheduler).state_dict()


def _fresh(model: Model, scheduler: bool) -> L.LightningModule:
    module = build(model, scheduler)
    module.load_state_dict(_initial(model, scheduler))
    return module


def _options(schedule: str, layout: Layout, model: Model, event: Event | None = None) -> dict[str, Any]:
    t = schedule_traits(schedule, layout.positions)
    chunks = microbatches(schedule, layout.positions)
    given = schedule_argument(schedule, layout.positions)
    options: dict[str, Any] = dict(chunks=chunks, **strategy_options(model))
    options["schedule_text" if schedule == TORCH_TEXT else "schedule"] = given
    if layout.stages is not None:
        options.update(stages=layout.stages, data_parallel=layout.data_parallel)
    if layout.rank_order is not None:
        options["rank_order"] = list(layout.rank_order)
    if layout.virtual_stages is not None:
        options["virtual_stages"] = layout.virtual_stages
    if layout.replicas_sync is not None:
        options.update(replicas_sync=layout.replicas_sync, replicas_sync_period=1)
    if t.predicts_ahead:  # the predictor that reads the model's optimizer state (the last update under plain SGD)
        options["xpipe_predictor"] = "update" if model.optimizer == "sgd" else "adam"
    if event is not None:
        options.update(event.strategy)
    return options


def _saves(folder: Path, **kwargs: Any) -> dict[str, Any]:
    return {"enable_checkpointing": True, "save": ModelCheckpoint(dirpath=folder, save_top_k=-1, **kwargs)}


def _pipeline_fit(
    schedule: str,
    event: Event,
    layout: Layout,
    model: Model,
    folder: Path,
    interrupt: str | None,
    first: list,
    also: list | None = None,
) -> L.LightningModule:
    """The cell's pipeline run(s); the trained module. ``first`` gets the callbacks of the first fit;
    ``also`` the other modules whose weights must be the same (the run that saved mid-epoch and went on)."""
    also = [] if also is None else also
    folder.mkdir(parents=True, exist_ok=True)
    options = _options(schedule, layout, model, event)
    loader = data(model, BATCH // layout.replicas, shuffle=layout.shuffle)
    rule = dict(event.rule)
    module = _fresh(model, event.scheduler)

    def fit(
        target: L.LightningModule,
        devices: int,
        steps: int,
        callbacks: list,
        save: Any = None,
        epochs: int = -1,
        **extra: Any,
    ) -> None:
        """Trains to ``steps`` (max_steps) or, where ``steps`` is -1, to ``epochs`` (max_epochs); every rank's
        logged values of this fit land in ``<folder>/logged``."""
        _fresh_port()
        logged = folder / "logged"
        logged.mkdir(exist_ok=True)
        for old in logged.glob("rank*.json"):
            old.unlink()
        fit_pipeline(
            target, devices, loader, max_steps=steps, max_epochs=epochs,
            callbacks=[*callbacks, _Logged(logged), *([save] if save else [])], **rule, **options, **extra,
        )  # fmt: skip

    if layout.elastic:
        watched = folder / "elastic"
        options["elastic"] = str(watched)
        worlds = (layout.devices, *layout.restart_on)
        stops = [STEPS * (i + 1) // len(worlds) for i in range(len(worlds))]
        for i, (devices, steps) in enumerate(zip(worlds, stops)):
            target = module if i == len(worlds) - 1 else _fresh(model, event.scheduler)
            fit(target, devices, steps, first if i == 0 else [], **_saves(watched, every_n_train_steps=1))
        return module
    # the resumes stop by epochs (max_epochs=1, then 2); only "stop_mid" stops and resumes by max_steps
    if interrupt == "resume_epoch":
        saved, epochs = folder / "ckpt", STEPS // STEPS_PER_EPOCH
        fit(_fresh(model, event.scheduler), layout.devices, -1, first, epochs=1, **_saves(saved, save_last=True))
        fit(module, layout.devices, -1, [], epochs=epochs, ckpt_path=str(saved / "last.ckpt"))
    elif interrupt in ("resume_mid", "stop_mid"):
        saved, at, epochs = folder / "ckpt", STEPS_PER_EPOCH + 1, STEPS // STEPS_PER_EPOCH
        straight = _fresh(model, event.scheduler)
        if interrupt == "resume_mid":  # the run that saves goes on: it must be the uninterrupted run too
            fit(straight, layout.devices, -1, first, epochs=epochs, **_saves(saved, every_n_train_steps=at))
            also.append(straight)
        else:
            fit(straight, layout.devices, at, first, **_saves(saved, every_n_train_steps=at))
        (path,) = saved.glob(f"*step={at}*")
        if interrupt == "resume_mid":
            fit(module, layout.devices, -1, [], epochs=epochs, ckpt_path=str(path))
        else:
            fit(module, layout.devices, STEPS, [], ckpt_path=str(path))
    elif interrupt == "save_every_step":
        fit(module, layout.devices, STEPS, first, **_saves(folder / "ckpt", every_n_train_steps=1))
    elif interrupt == "validate_mid":
        fit(module, layout.devices, STEPS, first, val_data=data(model, BATCH // layout.replicas), val_check_interval=2)
    else:
        fit(module, layout.devices, STEPS, first)
    return module


#: an oracle's weights and its logged values at the end of training (one process's, or every rank's)
Result = tuple[dict[str, torch.Tensor], list[dict[str, float]]]
_CACHE: dict[tuple, Result] = {}
_REFERENCES: dict[tuple, dict[str, torch.Tensor]] = {}


def _plain(event: Event, model: Model) -> Result:
    key = ("plain", event.name if event.rule or event.scheduler else "", model.name)
    if key not in _CACHE:
        module = _fresh(model, event.scheduler)
        trainer = fit_plain(module, data(model), max_steps=STEPS, max_epochs=-1, **event.rule)
        _CACHE[key] = module.state_dict(), [{k: float(v) for k, v in trainer.callback_metrics.items()}]
    return _CACHE[key]


def _straight(schedule: str, event: Event, layout: Layout, model: Model, folder: Path) -> Result:
    """The same schedule without the event's interruption (and, for a permuted placement, in rank order)."""
    layout = replace(layout, name=layout.name + "-straight", rank_order=None, restart_on=())
    if layout.devices == 2 and layout.stages is None:
        layout = replace(layout, name="p2")
    changes_rule = bool(event.rule or event.scheduler)
    key = ("straight", schedule, event.name if changes_rule else "", layout, model.name)
    if key not in _CACHE:  # an event that must not change the weights (a strategy option) runs without it here
        run = event if changes_rule else Event("straight")
        module = _pipeline_fit(schedule, run, layout, model, folder / "straight", None, [])
        _CACHE[key] = module.state_dict(), _logged(folder / "straight")
    return _CACHE[key]


def _records_delays(schedule: str, stages: int, chunks: int, module: Any) -> dict[str, int]:
    """The delay of each parameter of the records model (a BERT split by its blocks, uniformly): its
    embeddings with the first stage, each block with its stage, the head with the last."""
    from lightning_pipe.partition import balance_uniform, stage_bounds
    from lightning_pipe.schedules import update_delay

    bounds = stage_bounds(balance_uniform(len(module.bert.encoder.layer), stages))

    def stage(name: str) -> int:
        block = re.search(r"\.layer\.(\d+)\.", name)
        if block is None:
            return 0 if name.startswith("bert.embeddings.") else stages - 1
        return next(s for s, (a, b) in enumerate(bounds) if a <= int(block.group(1)) < b)

    return {n: update_delay(schedule, stages, chunks, stage(n)) for n, _ in module.named_parameters()}


def _delayed_rule(schedule: str, layout: Layout, model: Model) -> dict[str, torch.Tensor] | None:
    """The schedule's rule in one process, where it is written for the cell; None where the cell is not a
    plain chain of one stage per process (virtual stages, AvgPipe, elastic restarts) or its model is not
    one the rule's reference takes.

    The rules that stash weight versions (PipeDream, 2BW, WPipe), on the plain model, the one with skip
    connections (whose skips travel with their micro-batches) and the one that records its blocks' hidden
    states (their delays written out in :func:`_records_delays`): stage ``s`` applies
    at step ``t`` the gradient of batch ``t - d_s`` taken at the weights of step ``t - d_s`` (``d_s``:
    :func:`update_delay`), with the model's own optimizer; a stage with no gradient due yet does not step.
    PipeMare's and XPipe's, on the models whose split container is an attribute (the plain model, the
    block container, the one with parameters outside the split or a frozen norm), without replicas: the
    one-process reference of ``tests/async_reference.py`` with the strategy's defaults (PipeMare's
    rescheduling over 1000 updates and its correction), the pipeline drained at each epoch's end."""

    t = schedule_traits(schedule, layout.positions)
    plain_chain = layout.virtual_stages is None and layout.replicas_sync is None and not layout.elastic
    # without replicas: the rows of a replica's micro-batch i are not those of the whole batch's
    predicting = (t.predicts_weights or t.predicts_ahead) and layout.stages is None
    if not plain_chain or not (
        (t.stashes_weights and model.name in ("sequential", "sgd", "skips", "records"))
        or (predicting and model.name in ("sequential", "sgd", "blocks", "frozen", "outside"))
    ):
        return None
    key = ("delayed", schedule, layout.positions, model.name)
    if key not in _REFERENCES:
        module = _fresh(model, False)
        options = _options(schedule, layout, model)
        chunks, stages = options["chunks"], layout.positions
        batches = [batch for _ in range(STEPS // STEPS_PER_EPOCH) for batch in data(model)][:STEPS]
        if t.stashes_weights:
            _stashing_rule(module, model, schedule, stages, chunks, batches)
        else:
            from lightning_pipe.partition import balance_uniform
            from tests.async_reference import Rule, reference

            blocks = module.blocks if hasattr(module, "blocks") else module.layers
            balance = balance_uniform(len(blocks), stages)
            predictor = options.get("xpipe_predictor", "update")
            rule = Rule(schedule, warmup=1000 if t.predicts_weights else 0, correction=True, predictor=predictor)
            ends = range(STEPS_PER_EPOCH - 1, STEPS, STEPS_PER_EPOCH)
            reference(module, blocks, balance, batches, chunks, lambda m, x, y: m.loss((x, y)), rule, ends)
        _REFERENCES[key] = module.state_dict()
    return _REFERENCES[key]


def _stashing_rule(
    module: L.LightningModule, model: Model, schedule: str, stages: int, chunks: int, batches: list
) -> None:
    """PipeDream's, 2BW's and WPipe's rule on ``module`` (see :func:`_delayed_rule`)."""
    if model.records:
        delays = _records_delays(schedule, stages, chunks, module)
    else:
        delays = _stage_delays(schedule, stages, chunks, module)  # type: ignore[arg-type]
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    optimizer = module.configure_optimizers()
    history: list[dict[str, torch.Tensor]] = []
    for step, batch in enumerate(batches):
        if model.records:  # the micro-batches' losses as the pipeline weights them (the same sums)
            parts = list(zip(*(t.tensor_split(chunks) for t in batch)))
            loss = sum(module.loss(part) * (len(part[0]) / len(batch[0])) for part in parts)
        else:
            loss = module.loss(batch)
        grads = torch.autograd.grad(loss, list(params.values()))
        history.append(dict(zip(params, grads)))
        for name, p in params.items():
            source = step - delays[name]
            p.grad = history[source][name] if source >= 0 else None
        optimizer.step()


def _differences(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tolerance: dict) -> str | None:
    if list(expected) != list(got):
        return f"state_dict names differ: {sorted(set(expected) ^ set(got))}"
    worst = {
        name: (got[name] - expected[name]).abs().max().item()
        for name in expected
        if not torch.allclose(got[name], expected[name], **tolerance)
    }
    if not worst:
        return None
    name = max(worst, key=worst.__getitem__)
    return f"{len(worst)} of {len(expected)} tensors differ, most {name} by {worst[name]:.2e}"


def _logged_differences(expected: dict[str, float], ranks: list[dict[str, float]], tolerance: dict) -> str | None:
    """Every rank's logged training values (``train_loss``: a mean over the step's micro-batches) against the
    oracle's; None where they agree."""
    if not ranks:
        return "no rank wrote its logged values"
    for rank, got in enumerate(ranks):
        for name in ("train_loss",):
            if name not in got:
                return f"rank {rank} holds no {name!r} (it holds {sorted(got)})"
            if not torch.isclose(torch.tensor(got[name]), torch.tensor(expected[name]), **tolerance):
                return f"rank {rank}'s {name} is {got[name]:.8g}, the oracle's {expected[name]:.8g}"
    return None


def _predict_and_test(cell: Cell, module: L.LightningModule) -> str | None:
    """The pipeline's predictions and test loss on the fitted weights equal one process's."""
    layout = replace(cell.layout, restart_on=())
    options = _options(cell.schedule, layout, cell.model)
    alone = copy.deepcopy(module)
    loader = data(cell.model, BATCH // layout.replicas)
    expected = torch.cat(plain_trainer().predict(alone, data(cell.model)))  # type: ignore[arg-type]
    predicted = pipeline_trainer(layout.devices, **options).predict(module, loader)
    if predicted is None or not torch.allclose(torch.cat(predicted), expected, rtol=1e-4, atol=1e-6):
        return "predictions differ from one process's on the fitted weights"
    plain_loss = plain_trainer().test(alone, data(cell.model), verbose=False)[0]["test_loss"]
    piped_loss = pipeline_trainer(layout.devices, **options).test(module, loader, verbose=False)[0]["test_loss"]
    if abs(piped_loss - plain_loss) > 1e-5 * abs(plain_loss):
        return f"test_loss {piped_loss} against one process's {plain_loss}"
    return None


def run_cell(cell: Cell, folder: Path) -> Outcome:
    """Runs ``cell`` in ``folder`` and judges it."""
    sentence, t = refusal(cell), cell.traits
    interrupt = cell.event.interrupt
    if t.asynchronous and interrupt is None and (cell.event.rule or cell.event.scheduler):
        interrupt = "resume_epoch"  # no one-process rule here: the event's run must resume as it runs on
    try:
        also: list = []
        module = _pipeline_fit(
            cell.schedule, cell.event, cell.layout, cell.model, folder, interrupt, [_Started(folder)], also
        )
    except Exception as error:  # a refusal, or the cell's failure
        # what the model records is known in the first step's forward: refused there, before any update
        in_first_forward = sentence is not None and RECORDS_REFUSED in sentence.split("|")
        started = (folder / ("stepped" if in_first_forward else "started")).exists()
        text = f"{error}\n{''.join(traceback.format_exception(error))}"
        raised = re.findall(r"^(?:[\w.]+(?:Error|Exception)): .*$", text, flags=re.MULTILINE)
        first = (raised[-1] if raised else repr(error))[:300]  # the innermost (a process's own) error
        if sentence is None:
            return Outcome(cell.id, "fail", f"raised {'after' if started else 'before'} training: {first}")
        if started:
            return Outcome(cell.id, "fail", f"refused after training started: {first}")
        if not re.search(sentence, text, flags=re.IGNORECASE):
            return Outcome(cell.id, "fail", f"refused, but not with /{sentence}/: {first}")
        return Outcome(cell.id, "refused", first)
    if sentence is not None:
        return Outcome(cell.id, "fail", f"ran to the end although the traits refuse it (/{sentence}/)")
    return _judge(cell, module, also, interrupt, folder)


def _judge(cell: Cell, module: L.LightningModule, also: list, interrupt: str | None, folder: Path) -> Outcome:
    """The trained ``module`` (and ``also``, the runs that must equal it) against the cell's oracle."""
    t = cell.traits
    problems = []
    got = module.state_dict()
    if t.asynchronous or cell.layout.elastic or cell.layout.replicas_sync == "elastic" or cell.model.dropout:
        # the same schedule straight through, on the first world, in rank order (AvgPipe is no plain rule; dropout's
        # masks are the layout's own)
        expected, logged = _straight(cell.schedule, cell.event, cell.layout, cell.model, folder)
        tolerance, oracle = SAME, "uninterrupted" if cell.layout.elastic else "straight, in rank order"
        if any(world != cell.layout.devices for world in cell.layout.restart_on):
            # fewer replicas for a while: their gradients are accumulated where the uninterrupted run all-reduces
            # them, another order of the same float sums (3.3e-7 under Adam on torch's encoder on some CPUs)
            tolerance = PLAIN
        if cell.layout.restart_on and cell.layout.restart_on[-1] != cell.layout.devices:
            # fewer replicas accumulate to keep the global batch, and a step logs its last accumulated batch's
            # values (plain Lightning's accumulation): the uninterrupted run's logged values are another batch's
            logged = []
    else:
        (expected, logged), tolerance, oracle = _plain(cell.event, cell.model), PLAIN, "plain Lightning"
    # an asynchronous run without an interruption has no plain oracle: its predictions are compared, its weights
    # only where the rule is written out, or where a strategy option must leave them as the straight run's
    skip_weights = t.asynchronous and interrupt is None and cell.layout.rank_order is None and not cell.event.strategy
    if skip_weights and (reference := _delayed_rule(cell.schedule, cell.layout, cell.model)) is not None:
        expected, tolerance, oracle, skip_weights = reference, PLAIN, "the rule's one-process reference", False
        logged = []  # the rule written out logs nothing
    if not skip_weights:
        difference = _differences(expected, got, tolerance)
        if difference:
            problems.append(f"weights against {oracle}: {difference}")
        if logged and (difference := _logged_differences(logged[0], _logged(folder), tolerance)):
            problems.append(f"logged values against {oracle}: {difference}")
        for other in also:
            if difference := _differences(expected, other.state_dict(), tolerance):
                problems.append(f"the run that saved mid-epoch and went on, against {oracle}: {difference}")
    if cell.event.predict_test and (problem := _predict_and_test(cell, module)):
        problems.append(problem)
    if problems:
        return Outcome(cell.id, "fail", "; ".join(problems))
    return Outcome(cell.id, "pass", f"against {oracle}" + (" (predict/test only)" if skip_weights else ""))
