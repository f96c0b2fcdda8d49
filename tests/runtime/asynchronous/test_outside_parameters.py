"""Parameters outside the split layers under the asynchronous schedules: a Hugging Face model's
embeddings, final norm and head (``module=`` a block container), a Sequential's pre- and
post-processing. Each takes the weight versions, delay and prediction of the stage that uses it, so
the run equals the rule's one-process reference with those parameters counted in that stage."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from functools import reduce
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from lightning_pipe.partition import balance_uniform, stage_bounds
from lightning_pipe.runtime.asynchronous.pipemare import DEFAULT_DECAY
from lightning_pipe.schedules import update_delay
from tests.async_reference import Rule, own_loss, reference
from tests.hf_models import MODELS, HFModule, data_for, gpt2
from tests.pipeline import assert_same_weights, fit_pipeline

pytestmark = pytest.mark.timeout(300)

#: where the outside parameters of the tiny models are used: their input embeddings on the first stage
FIRST_STAGE = re.compile(r"(wte|wpe|embed_tokens|embed)\.")
BLOCK = re.compile(r"(?:\.h|\.layers|^blocks)\.(\d+)\.")


def stage_of(name: str, blocks: int, stages: int) -> int:
    """The stage that uses parameter ``name`` of a tiny GPT-2 or Llama split uniformly."""
    found = BLOCK.search(name)
    if found is None:
        return 0 if FIRST_STAGE.search(name) else stages - 1
    index = int(found.group(1))
    return next(s for s, (a, b) in enumerate(stage_bounds(balance_uniform(blocks, stages))) if a <= index < b)


def delayed_reference(
    module: Any,
    batches: list,
    schedule: str,
    stages: int,
    chunks: int,
    blocks: int,
    hf: bool = True,
    loss_of: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """One process: ``W_s(t+1) = step(W_s(t), grad_s f_{t - d_s}(W(t - d_s)))`` with the user's optimizer,
    each parameter in the stage that uses it (PipeDream's, 2BW's and WPipe's rule). ``hf``: the loss
    is the Hugging Face model's own, else the cross-entropy of the module's output; ``loss_of``: the
    batch's loss otherwise (one not additive over samples: its micro-batches' as the pipeline weights them)."""
    params = dict(module.named_parameters())
    delays = {n: update_delay(schedule, stages, chunks, stage_of(n, blocks, stages)) for n in params}
    optimizer = module.configure_optimizers()
    history: list[dict[str, torch.Tensor]] = []
    for t, (x, y) in enumerate(batches):
        if loss_of is not None:
            loss = loss_of(module, x, y)
        else:
            loss = module(x, y).loss if hf else torch.nn.functional.cross_entropy(module(x), y)
        history.append(dict(zip(params, torch.autograd.grad(loss, list(params.values())))))
        for name, p in params.items():
            p.grad = history[t - delays[name]][name] if t >= delays[name] else None
        optimizer.step()


def _model(name: str, optimizer: str = "sgd") -> HFModule:
    """The tiny model ``name`` of :data:`MODELS` ("gpt2_untied": GPT-2 with its head untied), seeded."""
    build = (lambda: gpt2(tied=False)) if name == "gpt2_untied" else MODELS[name][0]
    torch.manual_seed(0)
    return HFModule(build, optimizer)


def _path(name: str) -> str:
    """Where the model's block container lies."""
    return MODELS["gpt2" if name == "gpt2_untied" else name][1]


@pytest.mark.parametrize(
    "name, schedule, stages, chunks",
    [
        ("llama_gqa_untied", "pipedream", 2, 2),
        ("gpt2", "pipedream_2bw", 4, 3),  # the embedding tied to the head across the first and last stage
        pytest.param("llama_gqa_tied", "pipedream_2bw", 2, 2, marks=pytest.mark.slow),
        pytest.param("gpt2_untied", "wpipe", 2, 2, marks=pytest.mark.slow),
        pytest.param("gpt2_untied", "pipedream", 4, 1, marks=pytest.mark.slow),
        pytest.param("llama_gqa_untied", "wpipe", 4, 3, marks=pytest.mark.slow),
        pytest.param("llama_gqa_tied", "pipedream_2bw", 4, 3, marks=pytest.mark.slow),
    ],
)
def test_a_block_container_follows_the_delayed_update_rule(name: str, schedule: str, stages: int, chunks: int) -> None:
    piped = _model(name)
    expected = copy.deepcopy(piped)
    initial = copy.deepcopy(piped.state_dict())
    data = data_for("gpt2", batch_size=8)
    delayed_reference(expected, list(data)[:6], schedule, stages, chunks, blocks=4)
    fit_pipeline(piped, stages, data, module=_path(name), schedule=schedule, chunks=chunks, max_steps=6)
    assert_same_weights(expected, piped)
    norm = next(n for n in initial if n.endswith(("model.norm.weight", "ln_f.weight")))  # every stage holds it
    assert not torch.allclose(initial[norm], piped.state_dict()[norm])


#: name, schedule, stages, chunks, strategy options, whether the run also stops after 3 steps and resumes
#: (in the middle of the epoch: exact where chunks >= stages - 1, every backward at most one update late)
PREDICTING = [
    pytest.param("gpt2_untied", "pipemare", 2, 2, {}, True, id="gpt2-pipemare-2"),
    pytest.param("llama_gqa_untied", "xpipe", 2, 2, {}, False, id="llama-xpipe-2"),
    pytest.param("gpt2_untied", "pipemare", 4, 3, {}, True, id="gpt2-pipemare-4", marks=pytest.mark.slow),
    # stage 0's corrected backwards two updates after their forward
    pytest.param("gpt2_untied", "pipemare", 4, 2, {"pipemare_decay": 0.5}, False, id="gpt2-pipemare-4-gap-2",
                 marks=pytest.mark.slow),
    pytest.param("llama_gqa_untied", "pipemare", 2, 2, {"pipemare_correction": False}, True, id="llama-pipemare-2",
                 marks=pytest.mark.slow),
    pytest.param("llama_gqa_untied", "pipemare", 4, 3, {}, True, id="llama-pipemare-4", marks=pytest.mark.slow),
    # delays 3, 2, 1, 0: rescheduled step sizes that differ by stage, back to the user's after 4 updates
    pytest.param("llama_gqa_untied", "pipemare", 4, 1, {"pipemare_warmup": 4, "optimizer": "adamw"}, False,
                 id="llama-pipemare-4-rescheduled", marks=pytest.mark.slow),
    pytest.param("gpt2_untied", "xpipe", 2, 2, {"xpipe_predictor": "momentum"}, True, id="gpt2-xpipe-2",
                 marks=pytest.mark.slow),
    pytest.param("gpt2_untied", "xpipe", 4, 3, {"pipemare_warmup": 5}, True, id="gpt2-xpipe-4", marks=pytest.mark.slow),
    pytest.param("llama_gqa_untied", "xpipe", 4, 3, {}, True, id="llama-xpipe-4", marks=pytest.mark.slow),
    pytest.param("llama_gqa_untied", "xpipe", 4, 1, {"xpipe_predictor": "adam", "optimizer": "adamw"}, False,
                 id="llama-xpipe-4-adam", marks=pytest.mark.slow),
]  # fmt: skip


def _rule(schedule: str, options: dict[str, Any]) -> Rule:
    """The reference's rule for the strategy's ``options``, with the strategy's defaults where unset
    (PipeMare: rescheduling over K = 1000 updates and the correction on; XPipe: the "update" predictor)."""
    warmup = options.get("pipemare_warmup", 1000 if schedule == "pipemare" else 0)
    correction = options.get("pipemare_correction", schedule == "pipemare")
    decay = options.get("pipemare_decay", DEFAULT_DECAY)
    return Rule(schedule, warmup, correction, decay, options.get("xpipe_predictor", "update"))


@pytest.mark.parametrize("name, schedule, stages, chunks, options, resume", PREDICTING)
def test_a_block_container_follows_the_predicting_rule(
    tmp_path: Path, name: str, schedule: str, stages: int, chunks: int, options: dict[str, Any], resume: bool
) -> None:
    """PipeMare's and XPipe's rules through ``module=``: after 6 steps the weights of the rule's
    one-process reference (``tests/async_reference.py``, itself checked against the by-hand
    references on an MLP), the embeddings in the first stage, the final norm and head in the last;
    stopped after 3 steps with batches in flight and resumed to 6, the weights of 6 at once (the
    unapplied gradients, velocities and last updates of the parameters every stage holds, which one
    stage uses, come back to it)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    options = dict(options)
    optimizer = options.pop("optimizer", "sgd")
    path = _path(name)
    piped, expected, initial = _model(name, optimizer), _model(name, optimizer), _model(name, optimizer)
    data = data_for("gpt2", batch_size=8)  # 6 batches: the 6th step ends the epoch
    blocks, balance = reduce(getattr, path.split("."), expected), balance_uniform(4, stages)
    reference(expected, blocks, balance, list(data), chunks, own_loss, _rule(schedule, options))
    common: dict[str, Any] = dict(module=path, schedule=schedule, chunks=chunks, **options)
    fit_pipeline(piped, stages, data, max_steps=6, **common)
    assert_same_weights(expected, piped)
    assert not torch.allclose(initial.model.lm_head.weight, piped.model.lm_head.weight)
    if resume:
        stopped = _model(name, optimizer)
        saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)
        fit_pipeline(stopped, stages, data, max_steps=3, enable_checkpointing=True, callbacks=[saves], **common)
        fit_pipeline(stopped, stages, data, max_steps=6, ckpt_path=str(tmp_path / "last.ckpt"), **common)
        assert_same_weights(piped, stopped, rtol=0, atol=1e-7)


@pytest.mark.parametrize("name, schedule", [("llama_gqa_tied", "pipemare"), ("gpt2", "xpipe")])
def test_a_block_container_with_the_embedding_tied_to_the_head_is_refused(name: str, schedule: str) -> None:
    """The embedding tied to the head is used on the first and the last stage, whose delays differ:
    the rule gives it no single delay, and the strategy refuses it before training."""
    module, path = _model(name), _path(name)
    data = data_for("gpt2", batch_size=8)
    with pytest.raises(ValueError, match="no single delay"):
        reference(module, reduce(getattr, path.split("."), module), [2, 2], list(data), 2, own_loss, Rule(schedule))
    with pytest.raises(
        Exception, match=f"schedule='{schedule}' applies gradients with a different delay on each stage"
    ):
        fit_pipeline(module, 2, data, module=path, schedule=schedule, chunks=2, max_steps=6)


@pytest.mark.parametrize(
    "schedule",
    ["pipedream", pytest.param("pipemare", marks=pytest.mark.slow), pytest.param("xpipe", marks=pytest.mark.slow)],
)
def test_a_sequential_with_parameters_outside_it_follows_the_update_rule(schedule: str) -> None:
    """An input projection before the split Sequential (used on the first stage) and a head after it
    (on the last), under PipeDream's delays, PipeMare's and XPipe's rules on 2 stages."""
    from tests.async_reference import cross_entropy
    from tests.models import WrappedNet, loader

    torch.manual_seed(0)
    piped = WrappedNet()
    expected, initial = copy.deepcopy(piped), copy.deepcopy(piped)
    data = loader(n=60)  # 5 batches: the fifth step ends the epoch
    if schedule == "pipedream":
        delayed_reference(expected, list(data), "pipedream", 2, 2, blocks=4, hf=False)
    else:
        reference(expected, expected.blocks, [2, 2], list(data), 2, cross_entropy, _rule(schedule, {}))
    fit_pipeline(piped, 2, data, module="blocks", schedule=schedule, chunks=2, max_steps=5)
    assert_same_weights(expected, piped)
    assert not torch.allclose(initial.embed.weight, piped.embed.weight)
