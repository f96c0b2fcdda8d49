"""XPipe: asynchronous 1F1B whose forwards and backwards run on weights predicted for the update
that applies their gradient (see :mod:`lightning_pipe.runtime.asynchronous.xpipe`)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.config import PipelineConfig
from lightning_pipe.partition import balance_uniform
from lightning_pipe.runtime.asynchronous.xpipe import XPipe, predict_adam, predict_from_update, predict_momentum
from lightning_pipe.schedules import pipedream, render, unroll, update_delay, validate, versions_held, xpipe
from lightning_pipe.schedules.families.asynchronous import backward_gap
from tests.models import TinyNet, loader
from tests.pipeline import assert_same_weights, fit_pipeline
from tests.runtime.asynchronous.test_pipemare import _stage_of

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------------------- the schedule on paper
def test_xpipe_runs_pipedreams_order_and_delays_with_one_prediction_buffer() -> None:
    for p in range(1, 5):
        for m in range(1, 5):
            validate(unroll(xpipe(p, m), 3))
            assert xpipe(p, m).actions == pipedream(p, m).actions
            for s in range(p):
                assert update_delay("xpipe", p, m, s) == update_delay("pipedream", p, m, s)
    assert [versions_held("xpipe", 4, 1, s) for s in range(4)] == [2, 2, 2, 1]  # the last stage predicts nothing
    assert render(unroll(xpipe(2, 3), 3)).splitlines()[-1].endswith("weight versions per stage 2, 1")


# ---------------------------------------------------------------------------- the predictors, by hand
def test_the_update_predictor_repeats_the_last_update_s_times() -> None:
    w, last = torch.tensor([1.0, 2.0]), torch.tensor([0.1, -0.2])
    torch.testing.assert_close(predict_from_update(w, last, 3), torch.tensor([1.3, 1.4]))  # w + 3 * (w_t - w_t-1)
    assert predict_from_update(w, last, 0) is w


def test_the_adam_predictor_steps_s_times_along_the_bias_corrected_direction() -> None:
    w = torch.tensor([1.0, 3.0])
    m, v = torch.tensor([0.1, -0.2]), torch.tensor([0.04, 0.01])
    # k = 2, betas (0.9, 0.99): m_hat = m / 0.19, v_hat = v / 0.0199; w - 2 * 0.01 * m_hat / (sqrt(v_hat) + 1e-8)
    expected = torch.tensor([0.9925754021683337, 3.0296983911171913])
    torch.testing.assert_close(predict_adam(w, m, v, 2, 0.01, (0.9, 0.99), 1e-8, 2), expected)
    assert predict_adam(w, m, v, 0, 0.01, (0.9, 0.99), 1e-8, 2) is w  # no update yet


def test_the_momentum_predictor_steps_s_times_along_the_velocity() -> None:
    w, velocity = torch.tensor([1.0, -1.0]), torch.tensor([0.5, 0.25])
    torch.testing.assert_close(predict_momentum(w, velocity, 0.1, 2), torch.tensor([0.9, -1.05]))  # w - 2 * 0.1 * v


def test_predictions_of_bfloat16_weights_keep_their_dtype() -> None:
    w = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    out = predict_from_update(w, torch.tensor([0.5, 0.25]), 2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, torch.tensor([2.0, 2.5], dtype=torch.bfloat16))


def test_forwards_run_on_the_prediction_and_backwards_on_the_prediction_of_the_same_update() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(2, 2, bias=False)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    run = XPipe(layer, delay=2, predictor="momentum")
    run.attach([optimizer])
    assert run.nbytes() == 2 * 2 * 4  # the prediction buffer only: momentum reads the optimizer's state
    assert XPipe(layer, delay=2).nbytes() == 2 * (2 * 2 * 4)  # "update": the prediction and the last update
    assert XPipe(layer, delay=0).nbytes() == 0  # the last stage predicts nothing
    torch.testing.assert_close(run.forward_weights()["weight"], layer.weight.detach())  # no update yet: w
    layer.weight.grad = torch.ones(2, 2)
    run.before_update()
    optimizer.step()
    w1 = layer.weight.detach().clone()
    velocity = optimizer.state[layer.weight]["momentum_buffer"]
    forward = run.forward_weights()["weight"]
    torch.testing.assert_close(forward, w1 - 2 * 0.1 * velocity)  # s = 2 updates ahead
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    alias = forward.detach().requires_grad_(True)
    with run.saving():
        out = x @ alias.t()
    layer.weight.grad = torch.ones(2, 2)
    run.before_update()
    optimizer.step()  # one update later: the backward aims at the same update, 2 - 1 = 1 ahead
    velocity = optimizer.state[layer.weight]["momentum_buffer"]
    out.backward(torch.tensor([[1.0, 0.0]]))
    u = layer.weight.detach() - 1 * 0.1 * velocity
    torch.testing.assert_close(x.grad, torch.tensor([[1.0, 0.0]]) @ u)
    run.detach()
    plain = torch.optim.SGD(layer.parameters(), lr=0.1)
    run = XPipe(layer, delay=1, predictor="momentum")
    run.attach([plain])
    layer.weight.grad = torch.ones(2, 2)
    run.before_update()
    plain.step()
    with pytest.raises(ValueError, match="xpipe_predictor='update'"):
        run.forward_weights()


def test_options_and_their_errors() -> None:
    PipelineConfig(schedule="xpipe", xpipe_predictor="adam")
    with pytest.raises(ValueError, match="valid: update, adam, momentum"):
        PipelineConfig(schedule="xpipe", xpipe_predictor="nesterov")
    with pytest.raises(ValueError, match="schedule='pipemare' does not"):
        PipelineConfig(schedule="pipemare", xpipe_predictor="adam")
    with pytest.raises(ValueError, match="predicts its forwards' and backwards' weights ahead already"):
        PipelineConfig(schedule="xpipe", pipemare_correction=True)
    with pytest.raises(ValueError, match="recompute='never'"):
        PipelineConfig(schedule="xpipe", recompute="always")


# ---------------------------------------------------------------------------- the update rule, end to end
def _reference_xpipe(  # noqa: C901  the by-hand reference of XPipe's rule, one algorithm as the docstring states it
    model: TinyNet, batches: list, stages: int, chunks: int, make: Callable[[list], torch.optim.Optimizer], how: str
) -> None:
    """Single process, by hand: XPipe's rule with the delays of the schedule.

    Step ``t`` runs batch ``t``'s forwards on ``P_s(W(t), tau_s)``, the weights predicted ``tau_s``
    updates ahead (``how``: the predictor). Micro-batch ``i``'s backward on stage ``s`` runs in step
    ``t + gap`` (``backward_gap``; the last step drains every backward owed) with the forward's
    activations and, for its input gradient, ``P_s(W(t + gap), tau_s - gap)``. At the end of step
    ``t`` stage ``s``'s optimizer applies batch ``t - tau_s``'s gradient (none yet: no step)."""
    layers = list(model.layers)
    stage_of = _stage_of(model, stages)
    W = {i: {n: p.detach().clone() for n, p in layer.named_parameters()} for i, layer in enumerate(layers)}
    last_update = {i: {n: torch.zeros_like(v) for n, v in W[i].items()} for i in W}
    on = {s: [j for j in range(len(layers)) if stage_of[j] == s] for s in range(stages)}
    opts = {s: make([W[j][n] for j in on[s] for n in W[j]]) for s in range(stages)}
    tau = [update_delay("xpipe", stages, chunks, s) for s in range(stages)]

    def predict(j: int, n: str, steps: int) -> torch.Tensor:
        w = W[j][n]
        opt = opts[stage_of[j]]
        state, group = opt.state.get(w), opt.param_groups[0]
        if steps <= 0:
            return w
        if how == "update":
            return predict_from_update(w, last_update[j][n], steps)
        if not state:
            return w
        if how == "adam":
            k = int(state["step"])
            return predict_adam(
                w, state["exp_avg"], state["exp_avg_sq"], k, group["lr"], group["betas"], group["eps"], steps
            )
        return predict_momentum(w, state["momentum_buffer"], group["lr"], steps)

    last = len(batches) - 1
    saved: dict[tuple[int, int], list] = {}
    dy: dict[tuple[int, int], torch.Tensor] = {}
    grads: dict[tuple[int, int], dict[int, dict[str, torch.Tensor]]] = {}
    for t in range(len(batches)):
        ahead = {j: {n: predict(j, n, tau[stage_of[j]]) for n in W[j]} for j in W}
        x, y = batches[t]
        for i, (xi, yi) in enumerate(zip(x.chunk(chunks), y.chunk(chunks))):
            acts, h = [], xi
            for j, layer in enumerate(layers):
                out = torch.tanh(h) if isinstance(layer, nn.Tanh) else h @ ahead[j]["weight"].t() + ahead[j]["bias"]
                acts.append((h, out))
                h = out
            saved[(t, i)] = acts
            dy[(t, i)] = (torch.softmax(h, 1) - F.one_hot(yi, h.shape[1]).float()) / len(x)
        for s in reversed(range(stages)):
            for (b, i), acts in saved.items():
                if min(b + backward_gap(stages, chunks, s, i), last) != t:
                    continue
                gap = t - b
                g = dy[(b, i)]
                for j in reversed(on[s]):
                    h, out = acts[j]
                    if isinstance(layers[j], nn.Tanh):
                        g = g * (1 - out**2)
                        continue
                    mine = grads.setdefault((b, s), {}).setdefault(j, {n: torch.zeros_like(v) for n, v in W[j].items()})
                    mine["weight"] += g.t() @ h
                    mine["bias"] += g.sum(0)
                    g = g @ (ahead[j]["weight"] if gap == 0 else predict(j, "weight", tau[s] - gap))
                dy[(b, i)] = g
        for s in range(stages):
            source = grads.pop((t - tau[s], s), {})
            before = {j: {n: W[j][n].clone() for n in W[j]} for j in on[s]}
            for j in on[s]:
                for n in W[j]:
                    W[j][n].grad = source[j][n] if j in source else None
            opts[s].step()
            for j in on[s]:
                for n in W[j]:
                    last_update[j][n] = W[j][n] - before[j][n]
    with torch.no_grad():
        for j, layer in enumerate(layers):
            for n, p in layer.named_parameters():
                p.copy_(W[j][n])


OPTIMIZERS: dict[str, Callable[[list], torch.optim.Optimizer]] = {
    "plain-sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.1),
}


@pytest.mark.parametrize(
    "stages, chunks, optimizer, predictor",
    [(2, 1, "plain-sgd", "update"), (4, 2, "sgd", "update"), (4, 1, "sgd", "momentum"), (2, 2, "adam", "adam")],
    ids=["2-stages-update", "4-stages-update-momentum-sgd", "4-stages-momentum", "2-stages-adam"],
)
def test_weights_follow_the_xpipe_update_rule(stages: int, chunks: int, optimizer: str, predictor: str) -> None:
    torch.manual_seed(0)
    piped = TinyNet(lr=0.1, optimizer=optimizer)
    reference = TinyNet()
    reference.load_state_dict(piped.state_dict())
    steps = 6
    data = loader(n=12 * steps)
    _reference_xpipe(reference, list(data), stages, chunks, OPTIMIZERS[optimizer], predictor)
    fit_pipeline(piped, stages, data, schedule="xpipe", chunks=chunks, max_steps=steps, xpipe_predictor=predictor)
    assert_same_weights(reference, piped, rtol=1e-4, atol=1e-6)
    torch.manual_seed(0)
    assert not torch.allclose(TinyNet().layers[0].weight, piped.layers[0].weight)  # it trained


@pytest.mark.parametrize(
    "stages, chunks, optimizer, predictor",
    [(2, 1, "plain-sgd", "update"), (4, 2, "sgd", "update"), (4, 1, "sgd", "momentum"), (4, 3, "adam", "adam")],
    ids=["2-stages-update", "4-stages-update-momentum-sgd", "4-stages-momentum", "4-stages-adam"],
)
def test_the_generic_reference_equals_the_by_hand_one(stages: int, chunks: int, optimizer: str, predictor: str) -> None:
    """``tests/async_reference.py`` (see test_pipemare.py's test of the same name) gives on this MLP
    the by-hand rule's weights, and PipeMare's rule (no prediction) gives others."""
    from tests.async_reference import Rule, cross_entropy, reference

    torch.manual_seed(0)
    by_hand = TinyNet(lr=0.1, optimizer=optimizer)
    generic, other = copy.deepcopy(by_hand), copy.deepcopy(by_hand)
    data = list(loader(n=12 * 6))
    balance = balance_uniform(len(by_hand.layers), stages)
    _reference_xpipe(by_hand, data, stages, chunks, OPTIMIZERS[optimizer], predictor)
    reference(generic, generic.layers, balance, data, chunks, cross_entropy, Rule("xpipe", predictor=predictor))
    assert_same_weights(by_hand, generic, rtol=1e-5, atol=1e-7)
    reference(other, other.layers, balance, data, chunks, cross_entropy, Rule("pipemare", correction=False))
    pairs = zip(other.state_dict().values(), generic.state_dict().values())
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in pairs)


def test_the_prediction_changes_the_weights_against_pipedream() -> None:
    """Not PipeDream under another name: the same run under ``pipedream`` ends elsewhere."""
    torch.manual_seed(0)
    a = TinyNet(lr=0.1)
    b = TinyNet(lr=0.1)
    b.load_state_dict(a.state_dict())
    fit_pipeline(a, 2, schedule="xpipe", chunks=1, max_steps=6)
    fit_pipeline(b, 2, schedule="pipedream", chunks=1, max_steps=6)
    assert not torch.allclose(a.layers[0].weight, b.layers[0].weight, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------- checkpoints
def test_checkpoint_under_xpipe_resumes_exactly(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    options = dict(schedule="xpipe", chunks=1, max_steps=-1)  # 4 stages, 1 chunk: delays 3, 2, 1, 0
    torch.manual_seed(0)
    initial = TinyNet().state_dict()
    straight = TinyNet()
    straight.load_state_dict(initial)
    fit_pipeline(straight, 4, max_epochs=3, **options)
    first = TinyNet()
    first.load_state_dict(initial)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit_pipeline(first, 4, max_epochs=2, enable_checkpointing=True, callbacks=[ckpt], **options)
    saved = torch.load(tmp_path / "last.ckpt" / "stage-00000.pt", weights_only=False)
    state = saved["extra"]["async"]["pipemare"]
    assert state["updates"] == 12  # two epochs of six batches
    assert set(state["velocity"]) == {"0.weight", "0.bias"}  # stage 0's last update
    assert any(v.abs().sum() > 0 for v in state["velocity"].values())
    resumed = TinyNet()
    fit_pipeline(resumed, 4, ckpt_path=str(tmp_path / "last.ckpt"), max_epochs=3, **options)
    assert_same_weights(straight, resumed)


@pytest.mark.parametrize("predictor, optimizer", [("adam", "adam"), ("momentum", "sgd")])
def test_the_optimizer_state_predictors_resume_exactly(tmp_path: Path, predictor: str, optimizer: str) -> None:
    """The predictor reads the optimizer's state as it is now: a resume replaces the state and the
    param groups (``Optimizer.load_state_dict``), so a predictor holding the ones of the setup would
    read an empty state and predict no movement. Three epochs straight through, saving at each
    epoch's end (already drained there), against the third resumed from the second's end; with a
    learning-rate schedule and gradient clipping."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.models import ScheduledNet

    options = dict(schedule="xpipe", chunks=2, max_steps=-1, xpipe_predictor=predictor, gradient_clip_val=0.5)
    torch.manual_seed(0)
    straight = ScheduledNet(lr=0.1, optimizer=optimizer)
    resumed = ScheduledNet(lr=0.1, optimizer=optimizer)
    resumed.load_state_dict(straight.state_dict())
    saves = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    fit_pipeline(straight, 2, max_epochs=3, enable_checkpointing=True, callbacks=[saves], **options)
    fit_pipeline(resumed, 2, ckpt_path=str(tmp_path / "epoch=1.ckpt"), max_epochs=3, **options)
    assert_same_weights(straight, resumed, rtol=0, atol=1e-7)


def test_weights_tied_across_stages_are_refused() -> None:
    from tests.models import TiedNet, token_loader

    with pytest.raises(Exception, match="schedule='xpipe' applies gradients with a different delay on each stage"):
        fit_pipeline(TiedNet(), 2, token_loader(), schedule="xpipe", chunks=2)


def test_xpipe_with_replicas_equals_one_pipeline_on_the_global_batch() -> None:
    """Replicas average their gradients before the update, so their weights, last updates and
    predictions stay those of one pipeline on the doubled batch."""
    from tests.pipeline import twins

    torch.manual_seed(0)
    one, two = twins(TinyNet())
    options = dict(schedule="xpipe", chunks=1, max_steps=6)
    fit_pipeline(one, 2, data=loader(batch_size=24), **options)
    fit_pipeline(two, 4, data=loader(batch_size=12), stages=2, **options)
    assert_same_weights(one, two)
    torch.manual_seed(0)
    assert not torch.allclose(TinyNet().layers[0].weight, two.layers[0].weight)
