"""Models that read the outputs of blocks another stage runs, under ``module=`` a block container:
refused before training changes a weight, with what was read and what to do instead (without the
check they trained on wrong values, silently)."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Subset

from tests.models import ReadsBlocksNet, RecordWarnings, fit_plain, loader, plain_trainer
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
def test_hf_hidden_states_train_as_plain_over_more_stages(processes: int, options: dict, capfd) -> None:
    """Through a middle stage (received values sent on with its own) and the V-shaped and interleaved
    schedules (a process's two stages: what crosses between them too). Each boundary says once what
    crosses it, from the process that sends it (before: rank 0's only)."""
    torch.manual_seed(0)
    piped = BertLastFourCLS(layers=6, select=True)
    reference = copy.deepcopy(piped)
    fit_plain(reference, data_for("gpt2"))
    capfd.readouterr()
    fit_pipeline(piped, processes, data_for("gpt2"), module="bert.encoder.layer", chunks=4, **options)
    assert_same_weights(reference, piped)
    printed = "".join(capfd.readouterr())
    told = re.findall(r"stage (\d+) sends on with each micro-batch, beside the hidden state, what the model", printed)
    stages = processes * (2 if "schedule" in options and options["schedule"] != "1f1b" else 1)
    assert sorted(map(int, told)) == list(range(stages - 1)), printed[-2000:]


@pytest.mark.slow
def test_hf_hidden_states_train_as_plain_with_replicas() -> None:
    """2 stages x 2 replicas: each replica's pipeline carries its own micro-batches' hidden states."""
    torch.manual_seed(0)
    piped = BertLastFourCLS(layers=6, select=True)
    reference = copy.deepcopy(piped)
    fit_plain(reference, data_for("gpt2", batch_size=16))
    fit_pipeline(piped, 4, data_for("gpt2"), module="bert.encoder.layer", stages=2, chunks=2)
    assert_same_weights(reference, piped)


def test_hidden_states_are_refused_under_a_schedule_text_before_training() -> None:
    """A schedule given as text was never run with recorded values: refused in the first forward,
    naming why, the schedules that do carry them and the setting to turn off."""
    torch.manual_seed(0)
    model = BertLastFourCLS()
    before = copy.deepcopy(model.state_dict())
    text = "0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n"
    with pytest.raises(Exception, match=r"hidden states of every block \(output_hidden_states=True\)") as info:
        fit_pipeline(model, 2, data_for("gpt2"), module="bert.encoder.layer", schedule_text=text)
    message = str(info.value)
    assert "schedule text 'text' does not carry them yet (a schedule given as text" in message
    assert "pipemare" in message and "chimera" in message
    assert "output_hidden_states=False" in message
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def _gates(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(".mlp.gate.weight")}


def _as_replicas_read(data: DataLoader, replicas: int) -> DataLoader:
    """``data``'s samples in batches of ``replicas`` times its batch, each ordered replica by replica
    (replica ``r`` reads positions ``r, r + replicas, ...``): split into micro-batches, a global batch's
    parts are then the replicas' micro-batches (the load-balancing loss depends on which tokens share
    a forward)."""
    batch, dataset = data.batch_size, data.dataset
    assert batch is not None
    order = [
        start + r + replicas * k
        for start in range(0, len(dataset), batch * replicas)  # type: ignore[arg-type]
        for r in range(replicas)
        for k in range(batch)
    ]
    return DataLoader(Subset(dataset, order), batch_size=batch * replicas, shuffle=False)


def _moe_parity(
    name: str,
    processes: int,
    validate: bool = False,
    predict: bool = False,
    replicas: int = 1,
    warnings: str | None = None,
    **options: object,
) -> None:
    """``name`` with its load-balancing loss (coefficient 0.02) trained under the pipeline equals plain
    training on the same micro-batches (the loss, a product of per-expert means over a forward's
    tokens, is not additive over tokens: the pipeline's micro-batches are its forwards); with
    ``validate``, so does the validation loss of the trained model, with ``predict`` its predictions
    (the logits and each micro-batch's load-balancing loss). As many blocks as the schedule has stages
    (at least 4); ``replicas`` > 1: that many data-parallel replicas of ``processes / replicas`` stages;
    ``warnings``: a folder, and rank 0 (only) said once that the load-balancing loss is one per micro-batch."""
    build, path = MOE_MODELS[name]
    stages = processes // replicas
    virtual = 2 if options.get("schedule") in VIRTUAL_SCHEDULES else 1
    layers = max(4, stages * virtual)
    chunks = 2 * stages
    torch.manual_seed(0)
    piped = HFModule(lambda: build(layers, router_logits=True), microbatches=1)
    reference = copy.deepcopy(piped)
    reference.microbatches = chunks * replicas  # each replica's chunks of its share of the batch
    without = copy.deepcopy(reference)
    without.model.config.output_router_logits = False
    start = _gates(piped)
    plain_data = data_for(name) if replicas == 1 else _as_replicas_read(data_for(name), replicas)
    fit_plain(reference, plain_data)
    fit_plain(without, plain_data)
    more = {"stages": stages} if replicas > 1 else {}
    callbacks = [RecordWarnings(warnings)] if warnings else []
    fit_pipeline(piped, processes, data_for(name), module=path, chunks=chunks, callbacks=callbacks, **more, **options)
    assert_same_weights(reference, piped)  # every weight, the routers included
    if warnings:
        said = [_per_forward_lines(warnings, rank) for rank in range(processes)]
        assert len(said[0]) == 1 and "once per micro-batch" in said[0][0] and not any(said[1:]), said
    moved, aux = _gates(piped), _gates(without)
    assert start and all(not torch.equal(moved[n], start[n]) for n in start)
    # the load-balancing loss moved every router (of every stage) beyond the tolerance of the comparison
    assert all((moved[n] - aux[n]).abs().max() > 1e-4 for n in start)
    if validate:  # without gradients the router logits cross too, and the loss reads them all
        val = data_for(name, n=16, seed=1)
        plain = plain_trainer().validate(reference, val, verbose=False)[0]["val_loss"]
        piped_val = pipeline_trainer(processes, module=path, chunks=chunks, **more, **options).validate(
            piped, val, verbose=False
        )
        assert piped_val[0]["val_loss"] == pytest.approx(plain, rel=1e-5)
    if predict:  # the last stage's aux_loss reads the router logits of every stage's blocks
        val = data_for(name, n=16, seed=1)
        reference.microbatches = chunks
        expected = torch.cat(plain_trainer().predict(reference, val))
        got = torch.cat(pipeline_trainer(processes, module=path, chunks=chunks, **options).predict(piped, val))
        assert expected.shape[1] == 96 + 1  # the load-balancing loss beside the logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)  # from weights equal within 1e-6


def _per_forward_lines(folder: str, rank: int) -> list[str]:
    """What ``rank`` warned about a loss computed once per forward (see :class:`RecordWarnings`)."""
    warned = json.loads((Path(folder) / f"warnings{rank}.json").read_text())
    return [w for w in warned if "load-balancing loss" in w]


def test_the_moe_load_balancing_loss_trains_as_plain_under_1f1b(tmp_path) -> None:
    """Mixtral's router logits travel from blocks 0-1 to the last stage, which computes the loss; its
    gradient reaches the first stage's routers; validation and prediction read them too. That the loss
    is one per micro-batch is said once, at the first step."""
    _moe_parity("mixtral", 2, validate=True, predict=True, warnings=str(tmp_path), schedule="1f1b")


#: the schedules with two stages per process (as many blocks as stages: 8 on 4 processes)
VIRTUAL_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")

#: issue 53's grid: every mixture of experts with its load-balancing loss, on 2 and 4 processes, under
#: every schedule the issue names (Mixtral on 2 under 1F1B is the default run's case above)
MOE_GRID = [
    (name, processes, schedule)
    for name in MOE_MODELS
    for processes in (2, 4)
    for schedule in ("1f1b", "zero_bubble", "interleaved_1f1b", "zbv", "dualpipev")
    if (name, processes, schedule) != ("mixtral", 2, "1f1b")
]


@pytest.mark.slow
@pytest.mark.parametrize("name, processes, schedule", MOE_GRID, ids=[f"{n}-{p}p-{s}" for n, p, s in MOE_GRID])
def test_the_moe_load_balancing_loss_trains_as_plain_in_the_grid(name: str, processes: int, schedule: str) -> None:
    """Qwen3-MoE's block 1 is dense (it records no router logits; on 4 or more stages, a stage whose
    only block records none)."""
    _moe_parity(name, processes, schedule=schedule)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, processes, options",
    [
        ("mixtral", 2, {"schedule": "gpipe", "recompute": "always"}),
        ("mixtral", 2, {"schedule": "interleaved_zero_bubble"}),
        ("qwen2_moe", 4, {"schedule": "1f1b", "replicas": 2}),
        ("olmoe", 4, {"schedule": "zero_bubble", "replicas": 2, "predict": True}),
        ("qwen3_moe", 4, {"schedule": "zbv", "predict": True}),
    ],
    ids=[
        "mixtral-gpipe-recompute",
        "mixtral-izb",
        "qwen2_moe-2x2-1f1b",
        "olmoe-2x2-zb-predict",
        "qwen3_moe-4p-zbv-predict",
    ],
)
def test_the_moe_load_balancing_loss_trains_as_plain(name: str, processes: int, options: dict) -> None:
    """Recomputation, the interleaved zero bubble, 2 stages x 2 replicas (each replica's pipeline
    carries its own micro-batches' router logits), prediction through the V-shaped schedule."""
    _moe_parity(name, processes, **options)


def test_the_moe_load_balancing_loss_trains_as_plain_under_chimera() -> None:
    """Chimera's down pipeline runs the stages in reverse rank order: its micro-batches' router logits
    travel from the last rank to the first, as the up pipeline's travel the other way; each copy's
    gradients, the routers' included, summed with the other's."""
    _moe_parity("mixtral", 2, schedule="chimera")


@pytest.mark.slow
def test_the_moe_load_balancing_loss_trains_as_plain_under_chimera_on_4_processes() -> None:
    _moe_parity("qwen2_moe", 4, schedule="chimera")


def _micro_batched(chunks: int) -> Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss the pipeline computes for a batch: its micro-batches' own, weighted by their size."""

    def loss(module: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        parts = zip(x.tensor_split(chunks), y.tensor_split(chunks))
        return sum((module(a, b).loss * (len(a) / len(x)) for a, b in parts), torch.zeros(()))

    return loss


@pytest.mark.parametrize(
    "schedule, stages, chunks",
    [
        ("pipedream_2bw", 2, 2),
        pytest.param("pipedream", 2, 2, marks=pytest.mark.slow),
        pytest.param("wpipe", 2, 2, marks=pytest.mark.slow),
        pytest.param("pipedream", 4, 1, marks=pytest.mark.slow),
        pytest.param("pipedream_2bw", 4, 3, marks=pytest.mark.slow),
        pytest.param("wpipe", 4, 3, marks=pytest.mark.slow),
    ],
)
def test_the_moe_load_balancing_loss_follows_the_stashing_rule(schedule: str, stages: int, chunks: int) -> None:
    """Under the rules that stash weight versions, a micro-batch's router logits travel with it and
    their gradient goes back to the version its forward ran on: Mixtral with its load-balancing loss
    (and its embeddings and head outside the blocks) equals the rule's one-process reference, whose
    routers move differently without the loss."""
    from tests.runtime.asynchronous.test_outside_parameters import delayed_reference

    build, path = MOE_MODELS["mixtral"]
    torch.manual_seed(0)
    piped = HFModule(lambda: build(router_logits=True))
    reference, without = copy.deepcopy(piped), copy.deepcopy(piped)
    without.model.config.output_router_logits = False
    start = _gates(piped)
    batches = list(data_for("mixtral"))[:6]
    delayed_reference(reference, batches, schedule, stages, chunks, blocks=4, loss_of=_micro_batched(chunks))
    delayed_reference(without, batches, schedule, stages, chunks, blocks=4, loss_of=_micro_batched(chunks))
    fit_pipeline(piped, stages, data_for("mixtral"), module=path, schedule=schedule, chunks=chunks, max_steps=6)
    assert_same_weights(reference, piped)
    moved, aux = _gates(piped), _gates(without)
    assert start and all((moved[n] - aux[n]).abs().max() > 1e-4 for n in start)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_models_without_the_load_balancing_loss_train_as_plain(name: str, tmp_path) -> None:
    """Without the load-balancing loss nothing is computed per forward: nothing is said about it."""
    build, path = MOE_MODELS[name]
    torch.manual_seed(0)
    piped = HFModule(build)
    reference = copy.deepcopy(piped)
    fit_plain(reference, data_for(name))
    fit_pipeline(piped, 2, data_for(name), module=path, callbacks=[RecordWarnings(str(tmp_path))])
    assert_same_weights(reference, piped)
    assert not _per_forward_lines(str(tmp_path), 0) and not _per_forward_lines(str(tmp_path), 1)


@pytest.mark.parametrize("schedule", ["pipemare", pytest.param("xpipe", marks=pytest.mark.slow)])
def test_hidden_states_follow_the_rules_that_predict_weights(schedule: str) -> None:
    """PipeMare's and XPipe's rules (checked against their references on Sequentials): a BERT whose loss
    reads its last 4 layers' recorded hidden states trains as the same BERT run as a Sequential whose
    layers pass those layers' [CLS] on in a tuple (the same blocks on each stage, the embeddings and
    the head as its first and last layer)."""
    from lightning_pipe.partition import balance_uniform
    from tests.hf_models import PooledBert

    torch.manual_seed(0)
    piped = PooledBert()
    sequential = PooledBert(sequential=True)
    sequential.load_state_dict(piped.state_dict(), strict=False)
    common: dict[str, Any] = dict(schedule=schedule, chunks=2, max_steps=6)
    blocks = balance_uniform(4, 2)
    ends = [blocks[0] + 1, blocks[1] + 1]
    fit_pipeline(sequential, 2, data_for("gpt2"), module="layers", balance=ends, **common)
    fit_pipeline(piped, 2, data_for("gpt2"), module="bert.encoder.layer", balance=blocks, **common)
    expected = {k: v for k, v in sequential.state_dict().items() if not k.startswith("layers.")}
    assert list(expected) == list(piped.state_dict())
    for name, value in expected.items():
        torch.testing.assert_close(piped.state_dict()[name], value, rtol=1e-4, atol=1e-6, msg=name)
    assert not torch.equal(
        PooledBert().bert.encoder.layer[0].output.dense.weight, piped.bert.encoder.layer[0].output.dense.weight
    )
