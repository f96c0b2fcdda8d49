"""PipeMare: asynchronous 1F1B without weight stashing, with learning-rate rescheduling and
discrepancy correction (see :mod:`lightning_pipe.runtime.asynchronous.pipemare`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.config import PipelineConfig
from lightning_pipe.partition import balance_uniform, stage_bounds
from lightning_pipe.runtime.asynchronous.pipemare import (
    DEFAULT_DECAY,
    PipeMare,
    lr_factor,
    predicted_weight,
    velocity_decay,
)
from lightning_pipe.schedules import (
    pipedream,
    pipemare,
    render,
    steady_state_bubble,
    unroll,
    update_delay,
    validate,
    versions_held,
)
from lightning_pipe.schedules.families.asynchronous import backward_gap, step_actions
from tests.models import TinyNet, loader
from tests.pipeline import assert_same_weights, fit_pipeline

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------------------- the schedule on paper
def test_pipemare_runs_pipedreams_order_with_one_weight_version() -> None:
    for p in range(1, 6):
        for m in range(1, 7):
            steady = pipemare(p, m)
            validate(unroll(steady, 3))
            assert steady_state_bubble(steady) == pytest.approx(0.0, abs=1e-12)
            assert [a for a in steady.actions[0]] == [a for a in pipedream(p, m).actions[0]]
            for s in range(p):
                assert update_delay("pipemare", p, m, s) == update_delay("pipedream", p, m, s)
                assert versions_held("pipemare", p, m, s) == 1
    assert [update_delay("pipemare", 4, 1, s) for s in range(4)] == [3, 2, 1, 0]
    assert render(unroll(pipemare(2, 3), 3)).splitlines()[-1].endswith("weight versions per stage 1, 1")


@pytest.mark.parametrize("p, m", [(2, 1), (4, 2), (4, 3), (5, 2)])
def test_backward_gap_is_the_step_in_which_the_schedule_runs_the_backward(p: int, m: int) -> None:
    steady = pipemare(p, m)
    for s in range(p):
        ran_in = {}
        for step in range(4):
            for a in step_actions(steady, s, step):
                if a.kind.name == "B" and a.microbatch >= 0:
                    ran_in[a.microbatch] = step
        for g, step in ran_in.items():
            assert step - g // m == backward_gap(p, m, s, g % m)
        # the batch's gradient is complete in the step of its last backward: the update delay
        assert max(backward_gap(p, m, s, i) for i in range(m)) == update_delay("pipemare", p, m, s)


# ---------------------------------------------------------------------------- the two techniques, by hand
def test_lr_factor_per_stage_and_step_is_tau_to_the_minus_p_k() -> None:
    K = 4
    delays = [update_delay("pipemare", 4, 1, s) for s in range(4)]  # 3, 2, 1, 0
    expected = {  # tau ** -(1 - min(k / K, 1)), written out
        (0, 0): 1 / 3, (0, 1): 3 ** -0.75, (0, 2): 3 ** -0.5, (0, 3): 3 ** -0.25, (0, 4): 1.0, (0, 9): 1.0,
        (1, 0): 1 / 2, (1, 2): 2 ** -0.5, (1, 4): 1.0,
        (2, 0): 1.0, (3, 0): 1.0,  # a delay of 1, and the last stage's 0 (synchronous), keep the step size
    }  # fmt: skip
    for (s, k), value in expected.items():
        assert lr_factor(delays[s], k, K) == pytest.approx(value, rel=1e-12), (s, k)
    assert lr_factor(3, 0, 0) == 1.0  # K = 0: rescheduling off


def test_lr_factor_scales_the_users_step_and_composes_with_the_scheduler() -> None:
    layer = nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)  # chains on the group's lr
    mare = PipeMare(layer, delay=3, warmup=4, correction=False)
    mare.attach([optimizer])
    for k in range(7):
        user_lr = 0.5**k
        assert optimizer.param_groups[0]["lr"] == pytest.approx(user_lr)
        layer.weight.grad = torch.ones_like(layer.weight)
        before = layer.weight.detach().clone()
        mare.before_update()
        mare.before_update()  # handing over twice before one step scales once
        factor = 3 ** -(1 - min(k / 4, 1))
        assert optimizer.param_groups[0]["lr"] == pytest.approx(user_lr * factor)
        optimizer.step()
        torch.testing.assert_close(layer.weight.detach(), before - user_lr * factor)
        assert optimizer.param_groups[0]["lr"] == user_lr  # the user's value is back before the scheduler runs
        assert mare.updates == k + 1
        scheduler.step()
    mare.detach()
    assert not optimizer._optimizer_step_post_hooks


def test_lr_factor_scales_adam_groups_too() -> None:
    layer = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([{"params": [layer.weight], "lr": 0.1}, {"params": [layer.bias], "lr": 0.01}])
    mare = PipeMare(layer, delay=2, warmup=10, correction=True)
    mare.attach([optimizer])
    seen = []
    optimizer.register_step_pre_hook(lambda *_: None)
    original = optimizer.step

    def step(*args, **kwargs):  # the optimizer's own update sees the scaled step sizes
        seen.append([g["lr"] for g in optimizer.param_groups])
        return original(*args, **kwargs)

    optimizer.step = step  # type: ignore[method-assign]
    for p in layer.parameters():
        p.grad = torch.ones_like(p)
    mare.before_update()
    optimizer.step()
    assert seen == [[pytest.approx(0.1 / 2), pytest.approx(0.01 / 2)]]
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.01]


def test_predicted_weights_on_a_hand_computed_case() -> None:
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    delta = torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    torch.testing.assert_close(predicted_weight(w, delta, 2), torch.tensor([[0.8, 1.6], [2.4, 3.2]]))
    assert predicted_weight(w, delta, 0) is w


@pytest.mark.parametrize("correction", [True, False])
def test_the_backward_runs_on_the_predicted_weights_and_the_forwards_activations(correction: bool) -> None:
    layer = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))  # the forward's weights
    mare = PipeMare(layer, delay=2, warmup=0, correction=correction)
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    with mare.saving():
        out = layer(x)
    # two updates later: the weights moved, the velocity says by how much per update
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    if correction:
        mare.velocity["weight"].copy_(torch.tensor([[0.1, 0.2], [0.3, 0.4]]))
    mare.updates = 2
    out.backward(torch.tensor([[1.0, 0.0]]))
    # dx = dy @ u with u = w - 2 * delta = [[0.8, 1.6], [2.4, 3.2]] (or w itself without correction)
    expected = torch.tensor([[0.8, 1.6]]) if correction else torch.tensor([[1.0, 2.0]])
    torch.testing.assert_close(x.grad, expected)
    # dW = dy^T x: the forward's input, whatever the weights
    torch.testing.assert_close(layer.weight.grad, torch.tensor([[1.0, 2.0], [0.0, 0.0]]))
    torch.testing.assert_close(layer.weight.detach(), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # w untouched


def test_velocity_follows_the_updates_with_gamma_from_the_delay() -> None:
    layer = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    mare = PipeMare(layer, delay=3, warmup=0, correction=True)
    mare.attach([optimizer])
    gamma = DEFAULT_DECAY ** (1 / 3)
    assert mare.gamma == pytest.approx(gamma) and velocity_decay(0) == pytest.approx(DEFAULT_DECAY)
    expected = {n: torch.zeros_like(p) for n, p in layer.named_parameters()}
    for _step in range(4):
        for p in layer.parameters():
            p.grad = torch.randn_like(p)
        before = {n: p.detach().clone() for n, p in layer.named_parameters()}
        mare.before_update()
        optimizer.step()
        for n, p in layer.named_parameters():
            expected[n] = gamma * expected[n] + (1 - gamma) * (p.detach() - before[n])
            torch.testing.assert_close(mare.velocity[n], expected[n], rtol=1e-5, atol=1e-7)
    assert mare.nbytes() == sum(p.numel() * 4 for p in layer.parameters())  # one weight-sized buffer
    assert PipeMare(layer, delay=0, warmup=0, correction=True).nbytes() == 0  # the last stage needs none


def test_options_and_their_errors() -> None:
    """Their defaults per schedule: ``tests/test_resolve.py``."""
    PipelineConfig(schedule="pipedream", pipemare_warmup=100)
    PipelineConfig(schedule="pipemare", recompute="always", pipemare_correction=False)
    with pytest.raises(ValueError, match="synchronous"):
        PipelineConfig(schedule="1f1b", pipemare_warmup=100)
    with pytest.raises(ValueError, match="K >= 0"):
        PipelineConfig(schedule="pipemare", pipemare_warmup=-1)
    with pytest.raises(ValueError, match="keeps the forward's weights"):
        PipelineConfig(schedule="pipedream", pipemare_correction=True)
    with pytest.raises(ValueError, match="recompute='never', or pipemare_correction=False"):
        PipelineConfig(schedule="pipemare", recompute="except_last")
    PipelineConfig(schedule="pipemare", pipemare_decay=0.9)
    for bad in (0.0, 1.0, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            PipelineConfig(schedule="pipemare", pipemare_decay=bad)
    with pytest.raises(ValueError, match="which is off here"):
        PipelineConfig(schedule="pipemare", pipemare_correction=False, pipemare_decay=0.5)
    with pytest.raises(ValueError, match="which is off here"):
        PipelineConfig(schedule="pipedream", pipemare_decay=0.5)


# ---------------------------------------------------------------------------- the update rule, end to end
def _stage_of(model: TinyNet, stages: int) -> dict[int, int]:
    bounds = stage_bounds(balance_uniform(len(model.layers), stages))
    return {i: next(s for s, (a, b) in enumerate(bounds) if a <= i < b) for i in range(len(model.layers))}


def _reference_pipemare(
    model: TinyNet,
    batches: list,
    lr: float,
    stages: int,
    chunks: int,
    warmup: int,
    correction: bool,
    decay: float = DEFAULT_DECAY,
) -> None:
    """Single process, by hand: PipeMare's update rule with the delays of the schedule.

    Step ``t`` runs batch ``t``'s forwards on the current weights W(t). Micro-batch ``i``'s backward
    on stage ``s`` runs in step ``t + gap`` (``backward_gap``; the last step drains every backward
    owed), with the forward's activations and, for its input gradient, the weights
    ``W_s - gap * delta_s`` of that step (``W_s`` without correction). At the end of step ``t`` stage
    ``s`` applies batch ``t - tau_s``'s gradient with ``lr * tau_s ** -(1 - min(t / K, 1))``; then
    ``delta_s <- gamma_s * delta_s + (1 - gamma_s) * (W_s(t+1) - W_s(t))``."""
    layers = list(model.layers)
    stage_of = _stage_of(model, stages)
    W = {i: {n: p.detach().clone() for n, p in layer.named_parameters()} for i, layer in enumerate(layers)}
    delta = {i: {n: torch.zeros_like(v) for n, v in W[i].items()} for i in W}
    tau = [update_delay("pipemare", stages, chunks, s) for s in range(stages)]
    gamma = [velocity_decay(t, decay) for t in tau]
    last = len(batches) - 1
    saved: dict[tuple[int, int], list] = {}  # (batch, micro-batch) -> per layer (input, output)
    dy: dict[tuple[int, int], torch.Tensor] = {}  # gradient at the output of the stage done last
    grads: dict[tuple[int, int], dict[int, dict[str, torch.Tensor]]] = {}  # (batch, stage) -> per layer
    for t in range(len(batches)):
        x, y = batches[t]
        for i, (xi, yi) in enumerate(zip(x.chunk(chunks), y.chunk(chunks))):
            acts, h = [], xi
            for j, layer in enumerate(layers):
                out = torch.tanh(h) if isinstance(layer, nn.Tanh) else h @ W[j]["weight"].t() + W[j]["bias"]
                acts.append((h, out))
                h = out
            saved[(t, i)] = acts
            dy[(t, i)] = (torch.softmax(h, 1) - F.one_hot(yi, h.shape[1]).float()) / len(x)
        for s in reversed(range(stages)):  # this step's backwards: the later stage's first
            for (b, i), acts in saved.items():
                if min(b + backward_gap(stages, chunks, s, i), last) != t:
                    continue
                gap = t - b
                g = dy[(b, i)]
                for j in reversed([j for j in range(len(layers)) if stage_of[j] == s]):
                    h, out = acts[j]
                    if isinstance(layers[j], nn.Tanh):
                        g = g * (1 - out**2)
                        continue
                    mine = grads.setdefault((b, s), {}).setdefault(j, {n: torch.zeros_like(v) for n, v in W[j].items()})
                    mine["weight"] += g.t() @ h
                    mine["bias"] += g.sum(0)
                    u = W[j]["weight"] - gap * delta[j]["weight"] if correction else W[j]["weight"]
                    g = g @ u
                dy[(b, i)] = g
        for s in range(stages):  # the update at the end of step t
            factor = lr_factor(tau[s], t, warmup)
            source = grads.pop((t - tau[s], s), {})
            for j in [j for j in range(len(layers)) if stage_of[j] == s]:
                for n in W[j]:
                    new = W[j][n] - lr * factor * source[j][n] if j in source else W[j][n]
                    delta[j][n] = gamma[s] * delta[j][n] + (1 - gamma[s]) * (new - W[j][n])
                    W[j][n] = new
    with torch.no_grad():
        for j, layer in enumerate(layers):
            for n, p in layer.named_parameters():
                p.copy_(W[j][n])


@pytest.mark.parametrize(
    "stages, chunks, correction, decay",
    [(2, 1, True, None), (4, 2, True, 0.5), (4, 2, False, None)],
    ids=["2-stages", "4-stages-decay-0.5", "4-stages-uncorrected"],
)
def test_weights_follow_the_pipemare_update_rule(
    stages: int, chunks: int, correction: bool, decay: float | None
) -> None:
    torch.manual_seed(0)
    piped = TinyNet(lr=0.1)
    piped.optimizer = "plain-sgd"
    reference = TinyNet()
    reference.load_state_dict(piped.state_dict())
    steps, warmup = 6, 4
    data = loader(n=12 * steps)  # six full batches; the last step drains the pipeline
    _reference_pipemare(reference, list(data), 0.1, stages, chunks, warmup, correction, decay or DEFAULT_DECAY)
    fit_pipeline(
        piped, stages, data, schedule="pipemare", chunks=chunks, max_steps=steps, pipemare_warmup=warmup,
        pipemare_correction=correction, pipemare_decay=decay,
    )  # fmt: skip
    assert_same_weights(reference, piped, rtol=1e-4, atol=1e-6)
    torch.manual_seed(0)
    assert not torch.allclose(TinyNet().layers[0].weight, piped.layers[0].weight)  # it trained


@pytest.mark.parametrize(
    "stages, chunks, correction, decay, warmup",
    [(2, 1, True, DEFAULT_DECAY, 4), (4, 2, True, 0.5, 4), (4, 2, False, DEFAULT_DECAY, 4), (3, 1, True, 0.5, 0)],
    ids=["2-stages", "4-stages-decay-0.5", "4-stages-uncorrected", "3-stages-no-rescheduling"],
)
def test_the_generic_reference_equals_the_by_hand_one(
    stages: int, chunks: int, correction: bool, decay: float, warmup: int
) -> None:
    """``tests/async_reference.py`` runs the rule on any model split into stages (autograd on the
    weights the rule gives, the graph cut at the stages' ends), for the models no one differentiates
    by hand (a Hugging Face model through ``module=``). On this MLP it gives the by-hand rule's
    weights, and the rule's options change them by far more than the tolerance."""
    from tests.async_reference import Rule, cross_entropy, reference

    torch.manual_seed(0)
    by_hand = TinyNet(lr=0.1)
    by_hand.optimizer = "plain-sgd"
    generic, other = copy.deepcopy(by_hand), copy.deepcopy(by_hand)
    data = list(loader(n=12 * 6))
    balance = balance_uniform(len(by_hand.layers), stages)
    _reference_pipemare(by_hand, data, 0.1, stages, chunks, warmup, correction, decay)
    reference(
        generic, generic.layers, balance, data, chunks, cross_entropy, Rule("pipemare", warmup, correction, decay)
    )
    assert_same_weights(by_hand, generic, rtol=1e-5, atol=1e-7)
    flipped = Rule("pipemare", warmup, not correction, decay)  # the other side of the correction
    reference(other, other.layers, balance, data, chunks, cross_entropy, flipped)
    pairs = zip(other.state_dict().values(), generic.state_dict().values())
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in pairs)


def test_pipedream_with_lr_rescheduling_follows_the_scaled_delayed_rule() -> None:
    from tests.runtime.test_async_pipeline import _stage_delays

    torch.manual_seed(0)
    piped = TinyNet(lr=0.1)
    piped.optimizer = "plain-sgd"
    reference = TinyNet()
    reference.load_state_dict(piped.state_dict())
    stages, chunks, steps, warmup = 4, 1, 6, 4
    data = loader(n=12 * steps)
    delays = _stage_delays("pipedream", stages, chunks, reference)
    params = dict(reference.named_parameters())
    history = []
    for t, (x, y) in enumerate(data):  # W_s(t+1) = W_s(t) - lr * factor_s(t) * grad_s f_{t-d_s}(W(t-d_s))
        loss = F.cross_entropy(reference(x), y)
        history.append(dict(zip(params, torch.autograd.grad(loss, list(params.values())))))
        with torch.no_grad():
            for name, p in params.items():
                if t - delays[name] >= 0:
                    p -= 0.1 * lr_factor(delays[name], t, warmup) * history[t - delays[name]][name]
    fit_pipeline(piped, stages, data, schedule="pipedream", chunks=chunks, max_steps=steps, pipemare_warmup=warmup)
    assert_same_weights(reference, piped, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------- checkpoints
def test_checkpoint_under_pipemare_resumes_exactly(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    # 4 stages, 1 chunk: delays 3, 2, 1, 0, so the step size depends on k, and K lies past the resume
    options = dict(schedule="pipemare", chunks=1, pipemare_warmup=30, max_steps=-1)
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
    assert set(state["velocity"]) == {"0.weight", "0.bias"}  # stage 0's layers
    assert any(v.abs().sum() > 0 for v in state["velocity"].values())
    resumed = TinyNet()
    fit_pipeline(resumed, 4, ckpt_path=str(tmp_path / "last.ckpt"), max_epochs=3, **options)
    assert_same_weights(straight, resumed)


# ---------------------------------------------------------------------------- replicas
def test_pipemare_with_replicas_equals_one_pipeline_on_the_global_batch() -> None:
    """Replicas average their gradients before the update, so their weights, velocities and step
    sizes stay those of one pipeline on the doubled batch."""
    from tests.pipeline import twins

    torch.manual_seed(0)
    one, two = twins(TinyNet())
    options = dict(schedule="pipemare", chunks=1, pipemare_warmup=4, max_steps=6)
    fit_pipeline(one, 2, data=loader(batch_size=24), **options)
    fit_pipeline(two, 4, data=loader(batch_size=12), stages=2, **options)
    assert_same_weights(one, two)
    torch.manual_seed(0)
    assert not torch.allclose(TinyNet().layers[0].weight, two.layers[0].weight)


# ---------------------------------------------------------------------------- weight memory
class WeightMemory(L.Callback):
    """On every rank after training: parameter bytes, PipeDream's peak stashed bytes, PipeMare's velocity."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        run = trainer.strategy.pipeline.asynchronous
        record = {
            "params": sum(p.numel() * p.element_size() for p in trainer.strategy.pipeline.host.parameters()),
            "stashed": run.versions.peak_weight_bytes if run.stashes else 0,
            "velocity": run.pipemare.nbytes() if run.pipemare is not None else 0,
        }
        (self.folder / f"mem{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.parametrize("schedule", ["pipedream", "pipemare"])
def test_pipemare_holds_at_most_two_weight_copies_where_pipedream_stashes_more(tmp_path: Path, schedule: str) -> None:
    fit_pipeline(TinyNet(), 4, schedule=schedule, chunks=1, max_steps=6, callbacks=[WeightMemory(str(tmp_path))])
    records = [json.loads((tmp_path / f"mem{r}.json").read_text()) for r in range(4)]
    copies = [(r["params"] + r["stashed"] + r["velocity"]) / r["params"] for r in records]
    if schedule == "pipemare":
        assert copies == [2.0, 2.0, 2.0, 1.0]  # the weights and the velocity; the last stage needs no velocity
        assert all(r["stashed"] == 0 for r in records)
    else:  # delays 3, 2, 1, 0: up to 1 + 3 versions on the first stage
        assert copies == [4.0, 3.0, 2.0, 1.0]


def test_weights_tied_across_stages_are_refused() -> None:
    from tests.models import TiedNet, token_loader

    with pytest.raises(Exception, match="schedule='pipemare' applies gradients with a different delay on each stage"):
        fit_pipeline(TiedNet(), 2, token_loader(), schedule="pipemare", chunks=2)


# ---------------------------------------------------------------------------- weights that share one storage
class _TwoViews(nn.Module):
    """Two weights that are views of one flat buffer (as cuDNN's ``flatten_parameters`` lays out an
    LSTM's), each saved by its own matmul."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.tensor([0.5, -0.25, 0.75, 1.0, -0.5, 0.25, 1.5, -1.0])
        self.a = nn.Parameter(flat[:4].view(2, 2))
        self.b = nn.Parameter(flat[4:].view(2, 2))
        assert self.a.untyped_storage().data_ptr() == self.b.untyped_storage().data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(F.linear(x, self.a)), self.b)


def test_weights_sharing_one_storage_are_each_predicted_from_their_own_velocity() -> None:
    """Each view saved by the forward comes back as the prediction of its own parameter (before,
    one storage named one parameter: the other's view came back at a wrong offset)."""
    torch.manual_seed(0)
    model = _TwoViews()
    mare = PipeMare(model, delay=2, warmup=0, correction=True)
    x = torch.randn(3, 2, requires_grad=True)
    with mare.saving():
        out = model(x)
    h = torch.tanh(F.linear(x.detach(), model.a.detach()))  # the forward's activations
    new = {"a": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([[-1.0, 0.5], [2.0, -3.0]])}
    velocity = {"a": torch.tensor([[0.1, 0.2], [0.3, 0.4]]), "b": torch.tensor([[-0.2, 0.1], [0.4, -0.3]])}
    with torch.no_grad():  # two updates later, in place: the views still share the buffer
        for n in ("a", "b"):
            getattr(model, n).copy_(new[n])
            mare.velocity[n].copy_(velocity[n])
    mare.updates = 2
    dy = torch.tensor([[1.0, -1.0], [0.5, 2.0], [-1.5, 0.25]])
    out.backward(dy)
    u = {n: new[n] - 2 * velocity[n] for n in new}  # u = w - gap * delta, per parameter
    dh = dy @ u["b"]
    torch.testing.assert_close(model.b.grad, dy.t() @ h)
    torch.testing.assert_close(model.a.grad, (dh * (1 - h**2)).t() @ x.detach())
    torch.testing.assert_close(x.grad, (dh * (1 - h**2)) @ u["a"])
    for n in new:  # the weights themselves are untouched
        torch.testing.assert_close(getattr(model, n).detach(), new[n])


def test_the_velocity_of_bfloat16_weights_is_float32() -> None:
    """In bfloat16 the split update (``gamma * delta - (1 - gamma) * w_k``, then ``+ (1 - gamma) *
    w_{k+1}``) cancels two large terms and keeps mostly rounding; in float32 it is the velocity."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).to(torch.bfloat16)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.05)
    mare = PipeMare(layer, delay=2, warmup=0, correction=True)
    mare.attach([optimizer])
    assert {v.dtype for v in mare.velocity.values()} == {torch.float32}
    gamma = mare.gamma
    expected = {n: torch.zeros(p.shape) for n, p in layer.named_parameters()}
    for _step in range(5):
        for p in layer.parameters():
            p.grad = torch.randn_like(p)
        before = {n: p.detach().float() for n, p in layer.named_parameters()}
        mare.before_update()
        optimizer.step()
        for n, p in layer.named_parameters():
            expected[n] = gamma * expected[n] + (1 - gamma) * (p.detach().float() - before[n])
            torch.testing.assert_close(mare.velocity[n], expected[n], rtol=1e-5, atol=1e-6)
    assert any(v.abs().sum() > 0 for v in mare.velocity.values())
    # the backward's predicted weights: computed in float32, in the weights' dtype
    x = torch.randn(2, 4, dtype=torch.bfloat16, requires_grad=True)
    with mare.saving():
        out = layer(x)
    mare.updates += 2
    out.float().sum().backward()
    u = (layer.weight.detach().float() - 2 * mare.velocity["weight"]).to(torch.bfloat16)
    torch.testing.assert_close(x.grad, torch.ones(2, 3, dtype=torch.bfloat16) @ u)
    mare.detach()


def test_a_stage_whose_weights_share_one_storage_follows_the_pipemare_update_rule() -> None:
    """End to end: the first layer's weight and bias are views of one flat buffer (as cuDNN's
    ``flatten_parameters`` lays out an LSTM's weights); corrected backwards on stage 0 run after
    updates, so both views are predicted."""
    torch.manual_seed(0)
    piped = TinyNet(lr=0.1)
    piped.optimizer = "plain-sgd"
    first = piped.layers[0]
    flat = torch.cat([first.weight.detach().flatten(), first.bias.detach()])
    first.weight = nn.Parameter(flat[: first.weight.numel()].view_as(first.weight))
    first.bias = nn.Parameter(flat[first.weight.numel() :])
    assert first.weight.untyped_storage().data_ptr() == first.bias.untyped_storage().data_ptr()
    reference = TinyNet()
    reference.load_state_dict(piped.state_dict())
    steps, stages, chunks = 6, 4, 1
    data = loader(n=12 * steps)
    _reference_pipemare(reference, list(data), 0.1, stages, chunks, 4, True)
    fit_pipeline(piped, stages, data, schedule="pipemare", chunks=chunks, max_steps=steps, pipemare_warmup=4)
    assert_same_weights(reference, piped, rtol=1e-4, atol=1e-6)
