"""Parameters outside the split layers under the asynchronous schedules: a Hugging Face model's
embeddings, final norm and head (``module=`` a block container), a Sequential's pre- and
post-processing. Each takes the weight versions, delay and prediction of the stage that uses it, so
the run equals the rule's one-process reference with those parameters counted in that stage."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from lightning_pipe.partition import balance_uniform, stage_bounds
from lightning_pipe.schedules import update_delay
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


def _model(name: str, tied: bool | None = None) -> HFModule:
    build = MODELS[name][0] if tied is None else (lambda: gpt2(tied=tied))
    torch.manual_seed(0)
    return HFModule(build)


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
    piped = _model("gpt2", tied=False) if name == "gpt2_untied" else _model(name)
    reference = copy.deepcopy(piped)
    initial = copy.deepcopy(piped.state_dict())
    data = data_for("gpt2", batch_size=8)
    delayed_reference(reference, list(data)[:6], schedule, stages, chunks, blocks=4)
    path = MODELS["gpt2" if name == "gpt2_untied" else name][1]
    fit_pipeline(piped, stages, data, module=path, schedule=schedule, chunks=chunks, max_steps=6)
    assert_same_weights(reference, piped)
    norm = next(n for n in initial if n.endswith(("model.norm.weight", "ln_f.weight")))  # every stage holds it
    assert not torch.allclose(initial[norm], piped.state_dict()[norm])


@pytest.mark.parametrize(
    "schedule, stages, options",
    [
        # learning-rate rescheduling: stage 0 (delay 2) steps with half the last stage's step size
        ("pipemare", 4, {}),
        pytest.param("xpipe", 2, {}, marks=pytest.mark.slow),
        pytest.param("xpipe", 4, {"pipemare_warmup": 5}, marks=pytest.mark.slow),
        pytest.param("pipemare", 2, {"pipemare_warmup": 0}, marks=pytest.mark.slow),
    ],
)
def test_a_block_container_predicts_as_its_sequential_does(schedule: str, stages: int, options: dict) -> None:
    """PipeMare's and XPipe's rules (checked against their references on Sequentials): GPT-2 through
    ``module=`` (its embeddings, final norm and head outside the blocks) trains as the same GPT-2 as
    a Sequential whose first and last layers hold them (the same blocks on each stage)."""
    from tests.hf_models import BesideModule

    piped = _model("gpt2", tied=False)
    sequential = BesideModule(layers=4, tied=False)
    sequential.hf.load_state_dict(piped.model.state_dict())
    data = data_for("gpt2", batch_size=8)
    common: dict[str, Any] = dict(schedule=schedule, chunks=2, max_steps=6, **options)
    blocks = balance_uniform(4, stages)
    ends = [blocks[0] + 1, *blocks[1:-1], blocks[-1] + 1]  # the embeddings and the head as layers
    fit_pipeline(sequential, stages, data, module="layers", balance=ends, **common)
    fit_pipeline(piped, stages, data, module=MODELS["gpt2"][1], balance=blocks, **common)
    for name, value in sequential.hf.state_dict().items():
        torch.testing.assert_close(piped.model.state_dict()[name], value, rtol=1e-4, atol=1e-6, msg=name)
    trained = piped.model.transformer.wpe.weight
    assert not torch.allclose(_model("gpt2", tied=False).model.transformer.wpe.weight, trained)


@pytest.mark.parametrize("schedule", ["pipemare", pytest.param("pipedream", marks=pytest.mark.slow)])
def test_a_block_container_resumes_to_the_uninterrupted_weights(tmp_path: Path, schedule: str) -> None:
    """Stopped after 3 steps with batches in flight and resumed to 6, against 6 at once: the
    unapplied gradients (and PipeMare's velocity) of the position embeddings, which every stage
    holds and stage 0 uses, come back to stage 0."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    straight, stopped = _model("gpt2", tied=False), _model("gpt2", tied=False)
    data = data_for("gpt2", batch_size=8)
    common: dict[str, Any] = dict(module=MODELS["gpt2"][1], schedule=schedule, chunks=2)
    fit_pipeline(straight, 2, data, max_steps=6, **common)
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)
    fit_pipeline(stopped, 2, data, max_steps=3, enable_checkpointing=True, callbacks=[saves], **common)
    fit_pipeline(stopped, 2, data, max_steps=6, ckpt_path=str(tmp_path / "last.ckpt"), **common)
    assert_same_weights(straight, stopped, rtol=0, atol=1e-7)


def test_a_sequential_with_parameters_outside_it_follows_the_delayed_update_rule() -> None:
    """An input projection before the split Sequential (used on the first stage) and a head after it
    (on the last), under PipeDream's delays on 2 stages."""
    from tests.models import WrappedNet, loader

    torch.manual_seed(0)
    piped = WrappedNet()
    reference, initial = copy.deepcopy(piped), copy.deepcopy(piped)
    data = loader()
    delayed_reference(reference, list(data)[:5], "pipedream", 2, 2, blocks=4, hf=False)
    fit_pipeline(piped, 2, data, module="blocks", schedule="pipedream", chunks=2, max_steps=5)
    assert_same_weights(reference, piped)
    assert not torch.allclose(initial.embed.weight, piped.embed.weight)
