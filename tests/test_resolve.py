"""``resolve``: a run's arguments settled once for its layout into the typed values the pipeline runs
by. Pure: no process starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_pipe.config import PipelineConfig, arguments
from lightning_pipe.resolve import resolve
from lightning_pipe.runtime.asynchronous.pipemare import DEFAULT_WARMUP
from lightning_pipe.runtime.options import Activations, AllReduce, AsyncRule, ElasticAveraging
from lightning_pipe.runtime.topology import Layout
from lightning_pipe.schedules import TRAITS, ScheduleTraits, load_schedule, positions_for, traits
from lightning_pipe.schedules.runnable import runnable_schedule

#: 1F1B on 2 processes and 4 micro-batches, as torch's cells
ONE_F_ONE_B = "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"
#: ZB-H1-like on 2 processes and 2 micro-batches: the backward split into I and W
SPLIT = "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n"


def _unset(name: str) -> str:
    """What the docs, the YAML and the signature say ``None`` becomes for argument ``name``."""
    return next(a.unset for a in arguments() if a.name == name)


def test_the_defaults_are_resolved_for_the_layout() -> None:
    options = resolve(PipelineConfig(), Layout(3, 1))
    assert options.schedule is TRAITS["1f1b"] and isinstance(options.schedule, ScheduleTraits)
    assert (options.num_microbatches, options.virtual_stages) == (6, 1)
    assert options.activations == Activations(("never",) * 3, (None,) * 3)  # one value per pipeline stage
    assert (options.replicas_sync, options.rule, options.sharded) == (AllReduce(), AsyncRule(), False)
    interleaved = resolve(PipelineConfig(schedule="interleaved_1f1b", chunks=4, recompute="auto"), Layout(2, 1))
    assert (interleaved.num_microbatches, interleaved.virtual_stages) == (4, 2)
    assert len(interleaved.activations.recompute) == 4 and interleaved.activations.recompute[-1] == "never"


@pytest.mark.parametrize(
    "arguments, warmup, correction",
    [
        ({"schedule": "pipemare"}, DEFAULT_WARMUP, True),  # both on by default
        ({"schedule": "pipemare", "pipemare_correction": False, "pipemare_warmup": 0}, 0, False),
        ({"schedule": "pipedream"}, 0, False),  # off by default
        ({"schedule": "pipedream_2bw", "pipemare_warmup": 50}, 50, False),
    ],
)
def test_pipemare_switches_are_resolved_per_schedule(arguments: dict, warmup: int, correction: bool) -> None:
    rule = resolve(PipelineConfig(**arguments), Layout(2, 1)).rule
    assert (rule.pipemare_warmup, rule.pipemare_correction) == (warmup, correction)


def test_shard_holds_only_where_there_are_replicas() -> None:
    config = PipelineConfig(data_parallel="shard", recompute="always", gradient_accumulation_fusion=False)
    assert resolve(config, Layout(2, 2)).sharded
    alone = resolve(config, Layout(2, 1))
    assert not alone.sharded and alone.activations.recompute == ("always", "always")
    assert not alone.gradient_accumulation_fusion


def test_replicas_sync_is_a_value_with_its_mode() -> None:
    allreduce = resolve(PipelineConfig(), Layout(2, 2)).replicas_sync
    assert allreduce == AllReduce() and allreduce.mode == "allreduce"
    elastic = resolve(PipelineConfig(replicas_sync="elastic"), Layout(2, 2)).replicas_sync
    assert isinstance(elastic, ElasticAveraging) and elastic.mode == "elastic"
    assert elastic.alpha == pytest.approx(0.45)  # 0.9 / replicas
    given = PipelineConfig(replicas_sync="elastic", replicas_sync_alpha=0.2, replicas_sync_period=7)
    assert resolve(given, Layout(1, 4)).replicas_sync == ElasticAveraging(alpha=0.2, period=7)
    with pytest.raises(ValueError, match="this run has 1 replica"):
        resolve(PipelineConfig(replicas_sync="elastic"), Layout(2, 1))
    with pytest.raises(ValueError, match="past it"):
        resolve(PipelineConfig(replicas_sync="elastic", replicas_sync_alpha=0.5), Layout(1, 4))


def test_a_per_stage_list_of_another_length_is_refused_for_the_layout() -> None:
    config = PipelineConfig(recompute=["always", "never"])
    assert resolve(config, Layout(2, 1)).activations.recompute == ("always", "never")
    with pytest.raises(ValueError, match="gives 2 values but the pipeline has 4 stages"):
        resolve(config, Layout(4, 1))


def test_a_schedule_file_edited_after_resolve_does_not_change_the_run(tmp_path: Path) -> None:
    path = tmp_path / "mine.csv"
    path.write_text(ONE_F_ONE_B)
    options = resolve(PipelineConfig(schedule_text=path), Layout(2, 1))
    before = runnable_schedule(options.schedule, 2, 4, 1, rendezvous=False)
    path.write_text(SPLIT)  # another schedule: 2 micro-batches, the backward split
    assert traits(str(path)).split_backward and traits(str(path)).text.num_microbatches == 2  # type: ignore[union-attr]
    assert options.schedule.text.actions == load_schedule(ONE_F_ONE_B).actions  # type: ignore[union-attr]
    assert not options.schedule.split_backward
    assert options.num_microbatches == 4
    after = runnable_schedule(options.schedule, 2, 4, 1, rendezvous=False)
    assert after == before and not after.split_backward
    assert positions_for(options.schedule, 2, options.virtual_stages) == [0, 1]
    path.unlink()  # gone: the run still has its schedule
    assert runnable_schedule(options.schedule, 2, 3, 1, rendezvous=True).num_microbatches == 3


def test_the_documented_defaults_are_what_resolve_settles() -> None:
    """Each default that the docs, the YAML and the signature state is written once, in the constant the
    runtime uses: the number in the prose is the number a run gets."""
    p, replicas = 2, 3
    chunks = re.fullmatch(r"`(\d+) \* stages`, or a schedule text's count", _unset("chunks"))
    assert chunks is not None and resolve(PipelineConfig(), Layout(p, 1)).num_microbatches == int(chunks[1]) * p
    period = resolve(PipelineConfig(replicas_sync="elastic"), Layout(1, replicas)).replicas_sync
    assert isinstance(period, ElasticAveraging) and period.period == int(_unset("replicas_sync_period"))
    beta = re.fullmatch(r"([\d.]+) / replicas", _unset("replicas_sync_alpha"))
    assert beta is not None and period.alpha == pytest.approx(float(beta[1]) / replicas)
    pipemare = resolve(PipelineConfig(schedule="pipemare"), Layout(p, 1)).rule
    assert pipemare.pipemare_warmup == int(_unset("pipemare_warmup").split()[0])
    assert pipemare.pipemare_decay == float(_unset("pipemare_decay"))
    predictor = re.match(r'`"(\w+)"`', _unset("xpipe_predictor"))
    xpipe = resolve(PipelineConfig(schedule="xpipe"), Layout(p, 1)).rule
    assert predictor is not None and xpipe.xpipe_predictor == predictor[1]
    coefficients = dict(
        (name, float(value))
        for value, name in re.findall(r'([\d.]+) under `"(\w+)"`', _unset("delay_correction_coefficient"))
    )
    for schedule, correction in (("pipedream", "nesterov"), ("pipedream_2bw", "error_feedback")):
        rule = resolve(PipelineConfig(schedule=schedule, delay_correction=correction), Layout(p, 1)).rule
        assert rule.delay_correction_coefficient == coefficients[correction]
    virtual = re.fullmatch(r"the schedule's, (\d+) for (.*), else 1", _unset("virtual_stages"))
    assert virtual is not None
    named = re.findall(r'`"(\w+)"`', virtual[2])
    assert set(named) == {n for n, t in TRAITS.items() if t.virtual_stages > 1}
    for name in named:
        assert resolve(PipelineConfig(schedule=name, chunks=4), Layout(p, 1)).virtual_stages == int(virtual[1])
