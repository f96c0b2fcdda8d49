"""Delay corrections of the asynchronous schedules (``delay_correction=``): each run equals its rule's
one-process reference, resumes exactly from a checkpoint in the middle of an epoch, and is refused
before training where the schedule does not run it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_pipe.checkpoint.merged import merged_async_state
from lightning_pipe.config import PipelineConfig
from lightning_pipe.runtime.asynchronous.delay_correction import DelayCorrection, delay_correction
from lightning_pipe.runtime.asynchronous.rising_loss import RisingLoss
from lightning_pipe.trainer.compatibility import check_correction_optimizers
from tests.models import RecordWarnings, TinyNet, loader
from tests.pipeline import assert_same_weights, fit_pipeline
from tests.runtime.test_async_pipeline import _stage_delays

pytestmark = pytest.mark.timeout(240)


def nadam_equations(
    params: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    state: dict[str, dict],
    lr: float,
    beta1: float,
    weight_decay: float = 0.0,
) -> None:
    """One step of NAdam with decoupled weight decay as torch's documentation writes its algorithm (beta2 0.999,
    psi 0.004, eps 1e-8), on every parameter that has a gradient:
    theta <- theta - lr lambda theta; mu_t = beta1 (1 - 1/2 0.96^(t psi)); mu_{t+1} = beta1 (1 - 1/2 0.96^((t+1) psi));
    m_t = beta1 m_{t-1} + (1 - beta1) g_t; v_t = beta2 v_{t-1} + (1 - beta2) g_t^2;
    m^_t = mu_{t+1} m_t / (1 - prod_{i=1}^{t+1} mu_i) + (1 - mu_t) g_t / (1 - prod_{i=1}^{t} mu_i);
    v^_t = v_t / (1 - beta2^t); theta <- theta - lr m^_t / (sqrt(v^_t) + eps)."""
    beta2, psi, eps = 0.999, 0.004, 1e-8
    for name, g in grads.items():
        s = state.setdefault(name, {"t": 0, "mus": [], "m": torch.zeros_like(g), "v": torch.zeros_like(g)})
        s["t"] += 1
        t = s["t"]
        mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * psi))
        mu_next = beta1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
        s["mus"].append(mu_t)
        prod_t = math.prod(s["mus"])
        s["m"] = beta1 * s["m"] + (1 - beta1) * g
        s["v"] = beta2 * s["v"] + (1 - beta2) * g * g
        m_hat = mu_next * s["m"] / (1 - prod_t * mu_next) + (1 - mu_t) * g / (1 - prod_t)
        v_hat = s["v"] / (1 - beta2**t)
        with torch.no_grad():
            p = params[name]
            p -= lr * weight_decay * p
            p -= lr * m_hat / (v_hat.sqrt() + eps)


def _reference(
    model: torch.nn.Module, batches: list, lr: float, delays: dict[str, int], kind: str | None, coefficient: float
) -> None:
    """One process, each stage's delayed rule: at update t the parameter of a stage of delay d gets
    g_t = grad f_{t-d}(W(t-d)) (nothing while t < d), and ``"nesterov"``: steps by NAdam's equations
    (:func:`nadam_equations`, beta1 = coefficient), as the method's reference steps its stashed gradients;
    ``"error_feedback"``: Adam steps with c_t = g_t + beta (g_t - g_{t-1}) (c_t = g_t at the first update);
    None: plain SGD steps with g_t."""
    params = dict(model.named_parameters())
    history: list[dict[str, torch.Tensor]] = []
    state: dict = {}
    adam = torch.optim.Adam(model.parameters(), lr=lr)
    for t, (x, y) in enumerate(batches):
        loss = F.cross_entropy(model(x), y)
        history.append(dict(zip(params, torch.autograd.grad(loss, list(params.values())))))
        due = {name: history[t - delays[name]][name] for name in params if t - delays[name] >= 0}
        if kind == "nesterov":
            nadam_equations(params, due, state, lr, coefficient)
            continue
        for name, p in params.items():
            g = due.get(name)
            p.grad = None if g is None else g
            if g is not None and kind == "error_feedback":
                p.grad = g + coefficient * (g - state[name]) if name in state else g
                state[name] = g.clone()
        if kind == "error_feedback":
            adam.step()
            continue
        with torch.no_grad():
            for p in params.values():
                if p.grad is not None:
                    p -= lr * p.grad


def _batches(steps: int) -> list:
    out: list = []
    while len(out) < steps:
        out += list(loader())
    return out[:steps]


LR = 0.01


def _net(initial: dict[str, torch.Tensor], optimizer: str = "plain-sgd") -> TinyNet:
    """TinyNet with ``initial`` weights: plain SGD (what ``"nesterov"`` steps with) or Adam, at :data:`LR`."""
    net = TinyNet(lr=LR, optimizer=optimizer)
    net.load_state_dict(initial)
    return net


CASES = [
    # PipeDream on 2 stages: delays 1 and 0; NAdam's beta1 0.9 (0.99 moves less in 8 steps)
    pytest.param("pipedream", "nesterov", 0.9, 2, "plain-sgd", id="pipedream-nesterov"),
    pytest.param("pipedream_2bw", "error_feedback", 0.5, 2, "adam", id="2bw-error_feedback"),
]


@pytest.mark.parametrize("schedule, kind, coefficient, stages, optimizer", CASES)
def test_a_corrected_run_follows_its_rule_and_resumes_exactly(
    tmp_path: Path, schedule: str, kind: str, coefficient: float, stages: int, optimizer: str
) -> None:
    """8 steps of epochs of 6 batches (an epoch end's drain and its short batch) equal the rule's reference;
    a run stopped at step 5 (the pipeline full, its correction state saved) and resumed to 8 equals them."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    options: dict = dict(schedule=schedule, chunks=2, delay_correction=kind, delay_correction_coefficient=coefficient)
    torch.manual_seed(0)
    initial = TinyNet().state_dict()
    steps = 8
    reference, uncorrected = _net(initial, optimizer), _net(initial, optimizer)
    delays = _stage_delays(schedule, stages, 2, reference)
    _reference(reference, _batches(steps), LR, delays, kind, coefficient)
    # uncorrected: plain SGD's delayed rule, or Adam's with beta 0 (c_t = g_t)
    _reference(uncorrected, _batches(steps), LR, delays, None if kind == "nesterov" else kind, 0.0)
    assert not torch.allclose(reference.layers[0].weight, uncorrected.layers[0].weight, atol=1e-4)  # it corrects

    straight = _net(initial, optimizer)
    fit_pipeline(straight, stages, max_steps=steps, **options)
    assert_same_weights(reference, straight, rtol=1e-4, atol=1e-6)

    stopped = _net(initial, optimizer)
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)
    fit_pipeline(stopped, stages, max_steps=5, enable_checkpointing=True, callbacks=[saves], **options)
    resumed = _net(initial, optimizer)
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
    _reference(reference, _batches(9), LR, _stage_delays(schedule, 4, chunks, reference), "nesterov", 0.99)
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
        delay_correction("nesterov", 0.99, 2)
    assert delay_correction(None, None, 2) is None
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


def test_nesterov_with_plain_sgd_is_the_references_nadamw_step() -> None:
    """One process, gradients given: ``DelayCorrection("nesterov")`` stepped by ``SGD(lr, weight_decay)`` equals
    NAdam with decoupled weight decay written from its equations, and torch's ``NAdam`` as the method's
    reference builds it (``betas=(0.99, 0.999), momentum_decay=0.004, decoupled_weight_decay=True``), over 30
    steps, a parameter skipping updates (no gradient due) included."""
    torch.manual_seed(0)
    start = {"a": torch.randn(5, 3), "b": torch.randn(4)}
    grads = [{k: torch.randn_like(v) * (1 + t % 3) for k, v in start.items()} for t in range(30)]
    for g in grads[:4]:
        g.pop("b")  # "b"'s stage fills later: its step count starts later
    lr, wd = 0.01, 0.1
    ours = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    sgd = torch.optim.SGD(list(ours.values()), lr=lr, weight_decay=wd)
    correction = DelayCorrection("nesterov")
    equations = {k: v.clone() for k, v in start.items()}
    state: dict = {}
    torchs = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    nadam = torch.optim.NAdam(
        list(torchs.values()), lr=lr, betas=(0.99, 0.999), momentum_decay=0.004, weight_decay=wd,
        decoupled_weight_decay=True,
    )  # fmt: skip
    for g in grads:
        corrected = correction.correct(g, 1)
        for k, p in ours.items():
            p.grad = corrected.get(k)
        sgd.step()
        nadam_equations(equations, g, state, lr, 0.99, wd)
        for k, p in torchs.items():
            p.grad = g.get(k)
        nadam.step()
    for k in start:
        torch.testing.assert_close(ours[k].detach(), equations[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours[k].detach(), torchs[k].detach(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ours["a"].detach(), start["a"] - lr * sum(g["a"] for g in grads), atol=1e-3)
    assert correction.nbytes() == 2 * 4 * (15 + 4)  # two moments per weight


def test_each_correction_refuses_the_optimizers_it_would_make_diverge() -> None:
    """``"nesterov"`` takes plain SGD only (an Adam-sized rate, else it is told at the start); ``"error_feedback"``
    refuses SGD and takes Adam and AdamW. Each refusal names the optimizer to use."""
    params = [torch.nn.Parameter(torch.zeros(2))]
    for optimizer, message in [
        (torch.optim.SGD(params, lr=0.01, momentum=0.9), "SGD with momentum=0.9"),
        (torch.optim.Adam(params), "Adam: "),
        (torch.optim.AdamW(params), "AdamW: "),
        (torch.optim.NAdam(params), "NAdam: "),
    ]:
        with pytest.raises(MisconfigurationException, match=message) as refused:
            check_correction_optimizers("nesterov", [optimizer])
        assert "Use torch.optim.SGD(params, lr) without momentum" in str(refused.value)
    assert check_correction_optimizers("nesterov", [torch.optim.SGD(params, lr=0.001, weight_decay=0.1)]) is None
    told = check_correction_optimizers("nesterov", [torch.optim.SGD(params, lr=0.1)])
    assert told is not None and "Lower lr to an Adam-sized rate" in told
    clipped = check_correction_optimizers("nesterov", [torch.optim.SGD(params, lr=0.001)], gradient_clip_val=1.0)
    assert clipped is not None and "Leave gradient clipping off" in clipped
    assert check_correction_optimizers("error_feedback", [torch.optim.Adam(params)], gradient_clip_val=1.0) is None
    for optimizer in (torch.optim.SGD(params, lr=0.1, momentum=0.9), torch.optim.SGD(params, lr=0.1)):
        with pytest.raises(MisconfigurationException, match="Use torch.optim.AdamW or Adam"):
            check_correction_optimizers("error_feedback", [optimizer])
    for optimizer in (torch.optim.Adam(params, lr=0.1), torch.optim.AdamW(params, lr=0.1)):
        assert check_correction_optimizers("error_feedback", [optimizer]) is None
    assert check_correction_optimizers(None, [torch.optim.SGD(params, lr=0.1, momentum=0.9)]) is None


def test_a_pipeline_with_a_refused_optimizer_stops_before_training() -> None:
    """The refusal comes at setup, before the first batch (it reaches here through the spawned processes)."""
    with pytest.raises(Exception, match="delay_correction='nesterov'.*SGD with momentum=0.9"):
        fit_pipeline(TinyNet(), 2, schedule="pipedream", chunks=2, delay_correction="nesterov", max_steps=1)


def test_a_loss_rising_early_is_told_once() -> None:
    """The mean of the last 3 losses above the first loss by more than a quarter of it (or a loss not finite),
    within the first tenth of the steps: told once; a loss before any batch (nan) is not a first loss; after the
    watched steps nothing is told."""
    watch = RisingLoss("nesterov", 100)
    assert watch.observe(0, float("nan")) is None
    assert watch.observe(1, 2.0) is None  # the first loss
    assert watch.observe(2, 2.6) is None  # one noisy batch: the mean of 2 and 2.6 is within 2.5
    assert watch.observe(3, 2.9) is None  # 2, 2.6, 2.9: 2.5
    said = watch.observe(4, 3.0)  # 2.6, 2.9, 3.0
    assert said is not None and "rose from 2 (its first value) to 3 at step 4" in said and "Lower lr" in said
    assert watch.observe(5, 9.0) is None  # once
    late = RisingLoss("error_feedback", 100)
    late.observe(1, 2.0)
    assert late.observe(10, float("inf")) is not None  # not finite: at once
    unwatched = RisingLoss("error_feedback", 100)
    unwatched.observe(1, 2.0)
    assert unwatched.observe(11, 50.0) is None
    assert RisingLoss("nesterov", float("inf")).observe(0, 1.0) is None


def test_a_diverging_corrected_run_says_so_once(tmp_path: Path) -> None:
    """``"nesterov"`` at an SGD-sized rate (NAdam's steps of about lr = 3 per weight) climbs within its first
    tenth of 40 steps: rank 0 says so once, besides the rate told at the start; at an Adam-sized rate it says
    nothing."""
    import json

    for lr, rising in ((3.0, 1), (0.003, 0)):
        torch.manual_seed(0)
        record = RecordWarnings(str(tmp_path))
        net = TinyNet(lr=lr, optimizer="plain-sgd")
        fit_pipeline(net, 2, schedule="pipedream", chunks=2, delay_correction="nesterov", callbacks=[record],
                     max_steps=40)  # fmt: skip
        caught = json.loads((tmp_path / "warnings0.json").read_text())
        assert len([w for w in caught if "the corrected run is diverging" in w]) == rising, caught
