"""``PipelineOptions``: the values a :class:`~lightning_pipe.runtime.pipeline.StagePipeline` runs by.

The strategy's arguments are checked once, above the runtime, and keep the user's spelling (None
for "the schedule's default", ``chunks`` unset, ``data_parallel`` by name). The pipeline takes
only what it uses, already resolved for this run's layout, so nothing below reads the strategy's
arguments or decides their defaults again; ``assembly/split.py`` builds this value from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_pipe.runtime.replicas.elastic_averaging import DEFAULT_PERIOD


@dataclass(frozen=True)
class PipelineOptions:
    """How one rank's pipeline runs.

    Attributes:
        schedule: the training schedule's name (see :mod:`lightning_pipe.schedules`).
        num_microbatches: micro-batches per training batch (a short batch takes fewer).
        virtual_stages: stages per process (1 but for the interleaved schedules and ZB-V).
        recompute: activation recomputation, ``"always"``, ``"except_last"`` or ``"never"``, or one per pipeline stage.
        offload: per pipeline stage, the micro-batches whose saved activations it keeps in device memory,
            the later ones going to host memory (None: all kept; :mod:`lightning_pipe.runtime.activations.offload`).
        gradient_accumulation_fusion: each plain ``nn.Linear`` adds its weight gradient into
            ``.grad`` within its backward's matrix product (:mod:`lightning_pipe.runtime.grads.fused_linear`).
        sharded: the stage is sharded over its replicas with FSDP2 (only where there are replicas).
        pipemare_warmup: PipeMare's learning-rate rescheduling over this many updates (0: off).
        pipemare_correction: PipeMare's discrepancy correction on.
        pipemare_decay: the correction's velocity decay over one delay (None: PipeMare's default).
        xpipe_predictor: how ``xpipe`` predicts the weights (see :mod:`lightning_pipe.runtime.asynchronous.xpipe`).
        delay_correction: the correction of the gradients applied late (see
            :mod:`lightning_pipe.runtime.asynchronous.delay_correction`; None: off) and its coefficient
            (None: its default).
        replicas_sync_alpha: elastic averaging's coefficient between the replicas (0.0: their gradients are
            all-reduced every step instead; see :mod:`lightning_pipe.runtime.replicas.elastic_averaging`).
        replicas_sync_period: optimizer steps between two elastic averagings.
    """

    schedule: str
    num_microbatches: int
    virtual_stages: int = 1
    recompute: str | tuple[str, ...] = "never"
    offload: tuple[int | None, ...] = ()
    gradient_accumulation_fusion: bool = True
    sharded: bool = False
    pipemare_warmup: int = 0
    pipemare_correction: bool = False
    pipemare_decay: float | None = None
    xpipe_predictor: str = "update"
    delay_correction: str | None = None
    delay_correction_coefficient: float | None = None
    replicas_sync_alpha: float = 0.0
    replicas_sync_period: int = DEFAULT_PERIOD
