"""``PipelineOptions``: the values a :class:`~lightning_pipe.runtime.pipeline.StagePipeline` runs by.

The strategy's arguments keep the user's spelling (None for "the schedule's default", a schedule by
its name or its file). :func:`lightning_pipe.resolve.resolve` settles them once for the run's layout
into the typed parts below, so the pipeline reads values, never names: the schedule's traits (a
schedule text parsed then, so an edited file changes nothing under way), one activation setting per
stage, the replicas' synchronisation with its mode, and the asynchronous rule with every default
filled in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lightning_pipe.runtime.activations.recomputation import RecomputeMode
from lightning_pipe.runtime.asynchronous.delay_correction import Correction
from lightning_pipe.runtime.asynchronous.pipemare import DEFAULT_DECAY
from lightning_pipe.runtime.asynchronous.xpipe import DEFAULT_PREDICTOR, Predictor
from lightning_pipe.schedules.traits import ScheduleTraits


@dataclass(frozen=True)
class Activations:
    """What each pipeline stage (processes x virtual stages) does with its saved activations.

    Attributes:
        recompute: per stage, its recomputation mode.
        offload: per stage, the micro-batches whose saved activations it keeps in device memory, the
            later ones going to host memory (None: all kept; :mod:`lightning_pipe.runtime.activations.offload`).
    """

    recompute: tuple[RecomputeMode, ...]
    offload: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if len(self.recompute) != len(self.offload):
            raise ValueError(f"one recompute mode and one offload per stage; got {self.recompute} and {self.offload}")


@dataclass(frozen=True)
class AllReduce:
    """The replicas of a stage average their gradients every step (they train as one model)."""

    mode: Literal["allreduce"] = "allreduce"


@dataclass(frozen=True)
class ElasticAveraging:
    """Each replica steps on its own batches; every ``period`` optimizer steps the replicas and a
    center pull towards each other by ``alpha`` (:mod:`lightning_pipe.runtime.replicas.elastic_averaging`)."""

    alpha: float
    period: int
    mode: Literal["elastic"] = "elastic"


#: How the replicas of a stage stay together, its ``mode`` telling which.
ReplicasSync = AllReduce | ElasticAveraging


@dataclass(frozen=True)
class AsyncRule:
    """The asynchronous schedules' rule options, every default settled (unused under a synchronous schedule).

    Attributes:
        pipemare_warmup: PipeMare's learning-rate rescheduling over this many updates (0: off).
        pipemare_correction: PipeMare's discrepancy correction on.
        pipemare_decay: the correction's velocity decay over one delay.
        xpipe_predictor: how ``xpipe`` predicts the weights (:mod:`lightning_pipe.runtime.asynchronous.xpipe`).
        delay_correction: the correction of the gradients applied late (None: off;
            :mod:`lightning_pipe.runtime.asynchronous.delay_correction`).
        delay_correction_coefficient: its coefficient (None where it is off).
    """

    pipemare_warmup: int = 0
    pipemare_correction: bool = False
    pipemare_decay: float = DEFAULT_DECAY
    xpipe_predictor: Predictor = DEFAULT_PREDICTOR
    delay_correction: Correction | None = None
    delay_correction_coefficient: float | None = None


@dataclass(frozen=True)
class PipelineOptions:
    """How one rank's pipeline runs, resolved (:func:`lightning_pipe.resolve.resolve`).

    Attributes:
        schedule: the training schedule's traits (a schedule text's holding the text, parsed once).
        num_microbatches: micro-batches per training batch (a short batch takes fewer).
        virtual_stages: stages per process (1 but for the interleaved schedules and ZB-V).
        activations: each pipeline stage's recomputation and offload.
        gradient_accumulation_fusion: each plain ``nn.Linear`` adds its weight gradient into
            ``.grad`` within its backward's matrix product (:mod:`lightning_pipe.runtime.grads.fused_linear`).
        sharded: the stage is sharded over its replicas with FSDP2 (only where there are replicas).
        replicas_sync: how the replicas of a stage stay together.
        rule: the asynchronous schedules' rule options.
    """

    schedule: ScheduleTraits
    num_microbatches: int
    virtual_stages: int
    activations: Activations
    gradient_accumulation_fusion: bool = True
    sharded: bool = False
    replicas_sync: ReplicasSync = field(default_factory=AllReduce)
    rule: AsyncRule = field(default_factory=AsyncRule)
