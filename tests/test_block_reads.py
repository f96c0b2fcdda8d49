"""Models that read the outputs of blocks another stage runs, under ``module=`` a block container:
refused before training changes a weight, with what was read and what to do instead (without the
check they trained on wrong values, silently)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models import ReadsBlocksNet, fit_plain, loader, plain_trainer
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


def test_hf_hidden_states_pooled_over_the_last_layers_and_probed_train_and_evaluate_as_plain() -> None:
    """BERT pooling the last 4 layers' [CLS] (``output_hidden_states``) with a probe loss on layer 1:
    the hidden states of stage 0's blocks travel to the last stage with the micro-batch, their
    gradients back (before: refused as a read of other stages' blocks). Only the 5 selected hidden
    states are recorded; transformers records None for the others, and nothing is sent for those.
    Block 0's attention weights cross too (a term of the loss). Validation and prediction read them too."""
    torch.manual_seed(0)
    piped = BertLastFourCLS(layers=6, select=True)
    reference = copy.deepcopy(piped)
    start = piped.bert.encoder.layer[0].output.dense.weight.detach().clone()
    fit_plain(reference, data_for("gpt2"))
    fit_pipeline(piped, 2, data_for("gpt2"), module="bert.encoder.layer", chunks=2)
    assert_same_weights(reference, piped)
    assert not torch.equal(start, piped.bert.encoder.layer[0].output.dense.weight)  # the probe's gradient reached it
    val = data_for("gpt2", n=16, seed=1)
    plain = plain_trainer().validate(reference, val, verbose=False)[0]["val_loss"]
    options = {"module": "bert.encoder.layer", "chunks": 2}
    assert pipeline_trainer(2, **options).validate(piped, val, verbose=False)[0]["val_loss"] == pytest.approx(plain)
    predicted = torch.cat(pipeline_trainer(2, **options).predict(piped, val))
    torch.testing.assert_close(predicted, torch.cat(plain_trainer().predict(reference, val)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "processes, options",
    [(3, {"schedule": "1f1b"}), (2, {"schedule": "zbv"}), (2, {"schedule": "interleaved_1f1b", "virtual_stages": 2})],
    ids=["3p-1f1b", "2p-zbv", "2p-interleaved"],
)
def test_hf_hidden_states_train_as_plain_over_more_stages(processes: int, options: dict) -> None:
    """Through a middle stage (received values sent on with its own) and the V-shaped and interleaved
    schedules (a process's two stages: what crosses between them too)."""
    torch.manual_seed(0)
    piped = BertLastFourCLS(layers=6, select=True)
    reference = copy.deepcopy(piped)
    fit_plain(reference, data_for("gpt2"))
    fit_pipeline(piped, processes, data_for("gpt2"), module="bert.encoder.layer", chunks=4, **options)
    assert_same_weights(reference, piped)


@pytest.mark.slow
def test_hf_hidden_states_train_as_plain_with_replicas() -> None:
    """2 stages x 2 replicas: each replica's pipeline carries its own micro-batches' hidden states."""
    torch.manual_seed(0)
    piped = BertLastFourCLS(layers=6, select=True)
    reference = copy.deepcopy(piped)
    fit_plain(reference, data_for("gpt2", batch_size=16))
    fit_pipeline(piped, 4, data_for("gpt2"), module="bert.encoder.layer", stages=2, chunks=2)
    assert_same_weights(reference, piped)


def test_hidden_states_are_refused_under_an_asynchronous_schedule_before_training() -> None:
    """PipeDream-2BW (two weight versions) does not carry recorded values yet: refused in the first
    forward, naming the schedules that do and the setting to turn off. (It runs a block container
    only where nothing outside the blocks trains: the embeddings and heads are frozen.)"""
    torch.manual_seed(0)
    model = BertLastFourCLS()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".layer." in name)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(Exception, match=r"hidden states of every block \(output_hidden_states=True\)") as info:
        fit_pipeline(model, 2, data_for("gpt2"), module="bert.encoder.layer", schedule="pipedream_2bw")
    message = str(info.value)
    assert "schedule='pipedream_2bw' does not carry them yet" in message and "1f1b" in message
    assert "output_hidden_states=False" in message
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def _gates(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(".mlp.gate.weight")}


def _moe_parity(name: str, processes: int, validate: bool = False, **options: object) -> None:
    """``name`` with its load-balancing loss (coefficient 0.02) trained under the pipeline equals plain
    training on the same micro-batches (the loss, a product of per-expert means over a forward's
    tokens, is not additive over tokens: the pipeline's micro-batches are its forwards); with
    ``validate``, so does the validation loss of the trained model."""
    build, path = MOE_MODELS[name]
    chunks = 2 * processes
    torch.manual_seed(0)
    piped = HFModule(lambda: build(router_logits=True), microbatches=1)
    reference = copy.deepcopy(piped)
    reference.microbatches = chunks
    without = copy.deepcopy(reference)
    without.model.config.output_router_logits = False
    start = _gates(piped)
    fit_plain(reference, data_for(name))
    fit_plain(without, data_for(name))
    fit_pipeline(piped, processes, data_for(name), module=path, chunks=chunks, **options)
    assert_same_weights(reference, piped)  # every weight, the routers included
    moved, aux = _gates(piped), _gates(without)
    assert start and all(not torch.equal(moved[n], start[n]) for n in start)
    # the load-balancing loss moved every router (of every stage) beyond the tolerance of the comparison
    assert all((moved[n] - aux[n]).abs().max() > 1e-4 for n in start)
    if validate:  # without gradients the router logits cross too, and the loss reads them all
        val = data_for(name, n=16, seed=1)
        plain = plain_trainer().validate(reference, val, verbose=False)[0]["val_loss"]
        piped_val = pipeline_trainer(processes, module=path, chunks=chunks, **options).validate(
            piped, val, verbose=False
        )
        assert piped_val[0]["val_loss"] == pytest.approx(plain, rel=1e-5)


def test_the_moe_load_balancing_loss_trains_as_plain_under_1f1b() -> None:
    """Mixtral's router logits travel from blocks 0-1 to the last stage, which computes the loss; its
    gradient reaches the first stage's routers."""
    _moe_parity("mixtral", 2, validate=True, schedule="1f1b")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, processes, options",
    [
        ("mixtral", 2, {"schedule": "gpipe", "recompute": "always"}),
        ("mixtral", 2, {"schedule": "zero_bubble"}),
        ("mixtral", 2, {"schedule": "interleaved_1f1b", "virtual_stages": 2}),
        ("mixtral", 2, {"schedule": "zbv"}),
        ("mixtral", 2, {"schedule": "dualpipev"}),
        ("mixtral", 4, {"schedule": "1f1b"}),
        ("qwen2_moe", 2, {"schedule": "1f1b"}),
        ("qwen2_moe", 4, {"schedule": "zero_bubble"}),
        ("mixtral", 2, {"schedule": "interleaved_zero_bubble", "virtual_stages": 2}),
        ("qwen3_moe", 2, {"schedule": "1f1b"}),  # block 1 dense: it records no router logits
        ("qwen3_moe", 4, {"schedule": "1f1b"}),  # a stage whose only block records none
        ("olmoe", 2, {"schedule": "1f1b"}),
        ("olmoe", 4, {"schedule": "zero_bubble"}),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())) if isinstance(v, dict) else f"{v}p",
)
def test_the_moe_load_balancing_loss_trains_as_plain(name: str, processes: int, options: dict) -> None:
    _moe_parity(name, processes, **options)


def test_the_moe_load_balancing_loss_is_refused_under_an_asynchronous_schedule() -> None:
    """PipeDream (stashed weight versions) does not carry router logits yet: refused in the first
    forward, before any weight changed. (It runs a Hugging Face block container only where nothing
    outside the blocks trains: here the embeddings, final norm and head are frozen.)"""
    build, path = MOE_MODELS["mixtral"]
    torch.manual_seed(0)
    model = HFModule(lambda: build(router_logits=True))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".layers." in name)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(Exception, match=r"router logits .*schedule='pipedream' does not carry them yet") as info:
        fit_pipeline(model, 2, data_for("mixtral"), module=path, schedule="pipedream")
    message = str(info.value)
    assert "output_router_logits=False" in message and "T5" not in message and "BlockOutputsRefused" not in message
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_models_without_the_load_balancing_loss_train_as_plain(name: str) -> None:
    build, path = MOE_MODELS[name]
    torch.manual_seed(0)
    piped = HFModule(build)
    reference = copy.deepcopy(piped)
    fit_plain(reference, data_for(name))
    fit_pipeline(piped, 2, data_for(name), module=path)
    assert_same_weights(reference, piped)
