"""Parameters outside the split layers under the asynchronous schedules: a Hugging Face model's
embeddings, final norm and head (``module=`` a block container), a Sequential's pre- and
post-processing. Each takes the weight versions, delay and prediction of the stage that uses it, so
the run equals the rule's one-process reference with those parameters counted in that stage."""

from __future__ import annotations

import copy
import re
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
FIRST_STAGE = re.compile(r"(wte|wpe|embed_tokens)\.")
BLOCK = re.compile(r"\.(?:h|layers)\.(\d+)\.")


def stage_of(name: str, blocks: int, stages: int) -> int:
    """The stage that uses parameter ``name`` of a tiny GPT-2 or Llama split uniformly."""
    found = BLOCK.search(name)
    if found is None:
        return 0 if FIRST_STAGE.search(name) else stages - 1
    index = int(found.group(1))
    return next(s for s, (a, b) in enumerate(stage_bounds(balance_uniform(blocks, stages))) if a <= index < b)


def delayed_reference(module: HFModule, batches: list, schedule: str, stages: int, chunks: int, blocks: int) -> None:
    """One process: ``W_s(t+1) = step(W_s(t), grad_s f_{t - d_s}(W(t - d_s)))`` with the user's optimizer,
    each parameter in the stage that uses it (PipeDream's, 2BW's and WPipe's rule)."""
    params = dict(module.named_parameters())
    delays = {n: update_delay(schedule, stages, chunks, stage_of(n, blocks, stages)) for n in params}
    optimizer = module.configure_optimizers()
    history: list[dict[str, torch.Tensor]] = []
    for t, (x, y) in enumerate(batches):
        loss = module(x, y).loss
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
    ],
)
def test_a_block_container_follows_the_delayed_update_rule(name: str, schedule: str, stages: int, chunks: int) -> None:
    piped = _model("gpt2", tied=False) if name == "gpt2_untied" else _model(name)
    reference = copy.deepcopy(piped)
    data = data_for("gpt2", batch_size=8)
    delayed_reference(reference, list(data)[:6], schedule, stages, chunks, blocks=4)
    path = MODELS["gpt2" if name == "gpt2_untied" else name][1]
    fit_pipeline(piped, stages, data, module=path, schedule=schedule, chunks=chunks, max_steps=6)
    assert_same_weights(reference, piped)
    assert not torch.allclose(_model("gpt2" if "gpt2" in name else name).state_dict()[
        next(n for n in reference.state_dict() if "norm" in n or "ln_f" in n)], piped.state_dict()[
        next(n for n in reference.state_dict() if "norm" in n or "ln_f" in n)])  # fmt: skip
