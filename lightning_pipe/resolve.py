"""A run's arguments resolved once, for its layout, into the values the pipeline runs by.

:func:`resolve` is the one place where the defaults that depend on the schedule or the layout are
settled and the per-stage values computed: the launching process calls it as a dry run (what it
refuses fails before any process starts) and every rank calls it in its setup. What it returns holds
the schedule's traits, a schedule text parsed here once, so nothing downstream looks the schedule up
by name or reads its file again.
"""

from __future__ import annotations

from lightning_pipe.config import PipelineConfig
from lightning_pipe.runtime.activations.policy import offload_per_stage, recompute_per_stage
from lightning_pipe.runtime.asynchronous.delay_correction import DEFAULT_COEFFICIENTS
from lightning_pipe.runtime.asynchronous.pipemare import DEFAULT_DECAY, DEFAULT_WARMUP
from lightning_pipe.runtime.asynchronous.xpipe import DEFAULT_PREDICTOR
from lightning_pipe.runtime.microbatch import microbatch_count
from lightning_pipe.runtime.options import (
    Activations,
    AllReduce,
    AsyncRule,
    ElasticAveraging,
    PipelineOptions,
    ReplicasSync,
)
from lightning_pipe.runtime.replicas.elastic_averaging import DEFAULT_PERIOD, elastic_alpha
from lightning_pipe.runtime.topology import Layout
from lightning_pipe.schedules import ScheduleTraits, traits


def resolve(config: PipelineConfig, layout: Layout) -> PipelineOptions:
    """What a rank's pipeline runs by under ``config`` on ``layout`` (stages x replicas; a placement's
    ``layout``), refusing what the layout makes invalid (per-stage lists of another length, elastic
    averaging without replicas)."""
    schedule = traits(config.schedule)  # the run's one lookup: a text's file is read here, once
    num_microbatches = microbatch_count(config.chunks, schedule, layout.stages)
    virtual = config.virtual_stages or schedule.virtual_stages  # PipelineConfig settles it; None only when unset
    return PipelineOptions(
        schedule=schedule,
        num_microbatches=num_microbatches,
        virtual_stages=virtual,
        activations=_activations(config, schedule, layout.stages, num_microbatches, virtual),
        gradient_accumulation_fusion=config.gradient_accumulation_fusion,
        sharded=config.data_parallel == "shard" and layout.replicas > 1,
        replicas_sync=_replicas_sync(config, layout.replicas),
        rule=_rule(config, schedule),
    )


def _activations(
    config: PipelineConfig, schedule: ScheduleTraits, num_stages: int, num_microbatches: int, virtual: int
) -> Activations:
    """``recompute`` and ``offload`` per pipeline stage (``"auto"`` from the schedule's peaks)."""
    recompute = recompute_per_stage(config.recompute, schedule, num_stages, num_microbatches, virtual)
    offload = offload_per_stage(config.offload, schedule, num_stages, num_microbatches, virtual)
    return Activations(recompute, offload)


def _replicas_sync(config: PipelineConfig, replicas: int) -> ReplicasSync:
    """All-reduce, or elastic averaging with its coefficient for ``replicas`` and its period."""
    if config.replicas_sync != "elastic":
        return AllReduce()
    alpha = elastic_alpha(replicas, config.replicas_sync_alpha)
    return ElasticAveraging(alpha, config.replicas_sync_period or DEFAULT_PERIOD)


def _rule(config: PipelineConfig, schedule: ScheduleTraits) -> AsyncRule:
    """The asynchronous rule's options: PipeMare's techniques on by default under ``pipemare`` only,
    each unset number its constant's."""
    predicts = schedule.predicts_weights
    warmup, correction, decay = config.pipemare_warmup, config.pipemare_correction, config.pipemare_decay
    kind, coefficient = config.delay_correction, config.delay_correction_coefficient
    if kind is not None and coefficient is None:
        coefficient = DEFAULT_COEFFICIENTS[kind]
    return AsyncRule(
        pipemare_warmup=(DEFAULT_WARMUP if predicts else 0) if warmup is None else int(warmup),
        pipemare_correction=predicts if correction is None else bool(correction),
        pipemare_decay=DEFAULT_DECAY if decay is None else float(decay),
        xpipe_predictor=config.xpipe_predictor or DEFAULT_PREDICTOR,
        delay_correction=kind,
        delay_correction_coefficient=None if coefficient is None else float(coefficient),
    )
