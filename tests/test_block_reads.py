"""Models that read the outputs of blocks another stage runs, under ``module=`` a block container:
refused before training changes a weight, with what was read and what to do instead (without the
check they trained on wrong values, silently)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models import ReadsBlocksNet, fit_plain, loader
from tests.pipeline import assert_same_weights, fit_pipeline, pipeline_trainer


@pytest.mark.parametrize(
    "reads, what, block",
    [("pool", "The step's loss", "[0-9]"), ("statistic", "The step's loss", "0"), ("logged", "logged as 'probe'", "0")],
)
def test_a_step_reading_other_stages_block_outputs_is_refused(reads: str, what: str, block: str) -> None:
    """Pooled outputs in the loss, a detached statistic of block 0's output scaling it (no gradient
    reaches block 0's output), a probe on it that is only logged."""
    torch.manual_seed(0)
    with pytest.raises(
        Exception, match=rf"{what} depends on the output of block {block}, which another pipeline stage runs"
    ):
        fit_pipeline(ReadsBlocksNet(reads), 2, loader(), module="blocks")


def test_validation_and_prediction_reading_other_stages_block_outputs_are_refused() -> None:
    """Without gradients too: a model that pools every block's output, used only to evaluate."""
    torch.manual_seed(0)
    model = ReadsBlocksNet("pool")
    read = r"depends on the output of block [0-9], which another pipeline stage runs"
    with pytest.raises(Exception, match=rf"The value logged as 'val_loss' {read}"):
        pipeline_trainer(2, module="blocks").validate(model, loader(n=24))
    with pytest.raises(Exception, match=rf"What predict_step returned {read}"):
        pipeline_trainer(2, module="blocks").predict(model, loader(n=24))


transformers = pytest.importorskip("transformers")

from tests.hf_models import MOE_MODELS, BertLastFourCLS, HFModule, data_for  # noqa: E402


def test_hf_output_hidden_states_pooled_over_the_last_layers_is_refused() -> None:
    torch.manual_seed(0)
    with pytest.raises(Exception, match=r"records hidden_states from every block .*output_hidden_states=False"):
        fit_pipeline(BertLastFourCLS(), 2, data_for("gpt2"), module="bert.encoder.layer")


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_the_moe_load_balancing_loss_is_refused(name: str) -> None:
    build, path = MOE_MODELS[name]
    torch.manual_seed(0)
    model = HFModule(lambda: build(router_logits=True))
    with pytest.raises(Exception, match=r"router logits .*load-balancing loss .*output_router_logits=False") as info:
        fit_pipeline(model, 2, data_for(name), module=path)
    message = str(info.value)
    # only what applies: neither another refusal wrapped around it nor T5's advice
    assert "T5" not in message and "position bias" not in message and "BlockOutputsRefused" not in message
    assert "compute what you need" not in message


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_models_without_the_load_balancing_loss_train_as_plain(name: str) -> None:
    build, path = MOE_MODELS[name]
    torch.manual_seed(0)
    piped = HFModule(build)
    reference = copy.deepcopy(piped)
    fit_plain(reference, data_for(name))
    fit_pipeline(piped, 2, data_for(name), module=path)
    assert_same_weights(reference, piped)
