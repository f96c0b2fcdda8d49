"""Delay corrections of the asynchronous schedules (``delay_correction=``): each run equals its rule's
one-process reference, resumes exactly from a checkpoint in the middle of an epoch, and is refused
before training where the schedule does not run it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lightning_pipe.checkpoint.merged import merged_async_state
from lightning_pipe.config import PipelineConfig
from lightning_pipe.runtime.asynchronous.delay_correction import DelayCorrection, delay_correction, lookahead
from tests.models import TinyNet, loader
from tests.pipeline import assert_same_weights, fit_pipeline
from tests.test_async import _stage_delays

pytestmark = pytest.mark.timeout(240)


def _reference(
    model: torch.nn.Module, batches: list, lr: float, delays: dict[str, int], kind: str | None, coefficient: float
) -> None:
    """One process, the rule as :mod:`lightning_pipe.runtime.asynchronous.delay_correction` states it, with plain SGD:
    at update t the parameter of a stage of delay d gets g_t = grad f_{t-d}(W(t-d)) (nothing while t < d) and
    steps by c_t: ``"nesterov"``: v_t = gamma v_{t-1} + g_t, c_t = g_t + (gamma + ... + gamma^(d+1)) v_t;
    ``"error_feedback"``: c_t = g_t + beta (g_t - g_{t-1}), c_t = g_t at the first update; None: c_t = g_t."""
    params = dict(model.named_parameters())
    history: list[dict[str, torch.Tensor]] = []
    state: dict[str, torch.Tensor] = {}
    for t, (x, y) in enumerate(batches):
        loss = F.cross_entropy(model(x), y)
        history.append(dict(zip(params, torch.autograd.grad(loss, list(params.values())))))
        with torch.no_grad():
            for name, p in params.items():
                d = delays[name]
                if t - d < 0:
                    continue
                g = history[t - d][name]
                if kind == "nesterov":
                    v = state[name] = coefficient * state[name] + g if name in state else g.clone()
                    c = g + lookahead(coefficient, d) * v
                elif kind == "error_feedback":
                    c = g + coefficient * (g - state[name]) if name in state else g
                    state[name] = g.clone()
                else:
                    c = g
                p -= lr * c


def _batches(steps: int) -> list:
    out: list = []
    while len(out) < steps:
        out += list(loader())
    return out[:steps]


def _net(initial: dict[str, torch.Tensor]) -> TinyNet:
    net = TinyNet(lr=0.1, optimizer="plain-sgd")
    net.load_state_dict(initial)
    return net


CASES = [
    # PipeDream on 2 stages: delays 1 and 0, so the look-ahead differs between the stages
    pytest.param("pipedream", "nesterov", 0.8, 2, id="pipedream-nesterov"),
    pytest.param("pipedream_2bw", "error_feedback", 0.5, 2, id="2bw-error_feedback"),
]


@pytest.mark.parametrize("schedule, kind, coefficient, stages", CASES)
def test_a_corrected_run_follows_its_rule_and_resumes_exactly(
    tmp_path: Path, schedule: str, kind: str, coefficient: float, stages: int
) -> None:
    """8 steps of epochs of 6 batches (an epoch end's drain and its short batch) equal the rule's reference;
    a run stopped at step 5 (the pipeline full, its correction state saved) and resumed to 8 equals them."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    options: dict = dict(schedule=schedule, chunks=2, delay_correction=kind, delay_correction_coefficient=coefficient)
    torch.manual_seed(0)
    initial = TinyNet().state_dict()
    steps = 8
    reference, uncorrected = _net(initial), _net(initial)
    delays = _stage_delays(schedule, stages, 2, reference)
    _reference(reference, _batches(steps), 0.1, delays, kind, coefficient)
    _reference(uncorrected, _batches(steps), 0.1, delays, None, coefficient)
    assert not torch.allclose(reference.layers[0].weight, uncorrected.layers[0].weight, atol=1e-4)  # it corrects

    straight = _net(initial)
    fit_pipeline(straight, stages, max_steps=steps, **options)
    assert_same_weights(reference, straight, rtol=1e-4, atol=1e-6)

    stopped = _net(initial)
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)
    fit_pipeline(stopped, stages, max_steps=5, enable_checkpointing=True, callbacks=[saves], **options)
    resumed = _net(initial)
    fit_pipeline(resumed, stages, ckpt_path=str(tmp_path / "last.ckpt"), max_steps=steps, **options)
    assert_same_weights(straight, resumed, rtol=0, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, chunks", [("pipedream", 2), ("wpipe", 3)])
def test_nesterov_on_four_stages_follows_its_rule(schedule: str, chunks: int) -> None:
    """4 stages: PipeDream's delays 2, 1, 1, 0 (2 micro-batches), WPipe's 1, 1, 0, 0; each stage's look-ahead
    its own."""
    torch.manual_seed(0)
    initial = TinyNet().state_dict()
    reference, piped = _net(initial), _net(initial)
    _reference(reference, _batches(9), 0.1, _stage_delays(schedule, 4, chunks, reference), "nesterov", 0.9)
    fit_pipeline(piped, 4, schedule=schedule, chunks=chunks, max_steps=9, delay_correction="nesterov")
    assert_same_weights(reference, piped, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(schedule="1f1b", delay_correction="nesterov"), "Use schedule='pipedream' or 'pipedream_2bw' or 'wpipe'"),
        (dict(schedule="xpipe", delay_correction="nesterov"), "XPipe have their own corrections"),
        (dict(schedule="pipedream", delay_correction="error_feedback"), "Use schedule='pipedream_2bw'"),
        (dict(schedule="pipedream_2bw", delay_correction_coefficient=0.5), "none is on"),
        (dict(schedule="pipedream_2bw", delay_correction="nesterov", delay_correction_coefficient=1.0), r"\[0, 1\)"),
        (dict(schedule="pipedream_2bw", delay_correction="momentum"), "not a delay correction"),
    ],
)
def test_what_a_correction_does_not_run_is_refused_before_training(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**arguments)


def test_replicas_are_refused_and_merged_checkpoints_keep_every_stages_state() -> None:
    with pytest.raises(ValueError, match="Run one replica"):
        delay_correction(SimpleNamespace(delay_correction="nesterov", delay_correction_coefficient=None), 2)
    assert delay_correction(SimpleNamespace(delay_correction=None, delay_correction_coefficient=None), 2) is None
    stages = []
    for name in ("layers.0.weight", "layers.4.weight"):
        correction = DelayCorrection("error_feedback")
        correction.correct({name: torch.ones(2)}, 1)
        state = {"step": 3, "pending": {}, "delay_correction": correction.state_dict()}
        stages.append({"extra": {"async": state}})
    merged = merged_async_state(stages)
    assert merged is not None
    assert sorted(merged["delay_correction"]["buffers"]) == ["layers.0.weight", "layers.4.weight"]
    resumed = DelayCorrection("error_feedback")
    resumed.load_state_dict(merged["delay_correction"])
    assert torch.equal(resumed.correct({"layers.0.weight": 3 * torch.ones(2)}, 1)["layers.0.weight"], 4 * torch.ones(2))
    with pytest.raises(ValueError, match="resume it with the delay_correction it was saved with"):
        DelayCorrection("nesterov").load_state_dict(merged["delay_correction"])
