"""Every ``PipelineStrategy`` argument as one frozen value, checked once where the user wrote it.

Each argument is written once, here: a field of one of the groups below (torchtitan's way: a frozen
dataclass per concern, a docstring under each field, each group with its own ``check()``), with its
default, its values and what ``None`` means in the field's metadata (:func:`option`).
``PipelineStrategy(**kwargs)`` takes the flat keywords (:func:`split_arguments`) and shows them in its
signature (:func:`strategy_signature`); the command line's keys, ``lightning_pipe/conf/strategy/pipeline.yaml`` and
docs/usage.md's table come from the same fields (:mod:`lightning_pipe.config_files`).

The strategy, the planner and the pipeline read the same :class:`PipelineConfig`; nothing
changes it in place. ``plan="auto"`` gets a new one from the planner (:meth:`PipelineConfig.replace`),
so the values a run uses are always the ones that were checked, and no module below the
strategy needs the strategy object to learn or to change them.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import textwrap
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

from torch import nn

from lightning_pipe.command_keys import DEPRECATED
from lightning_pipe.partition.solvers.rank_order import check_rank_order
from lightning_pipe.partition.solvers.speeds import check_rank_speeds
from lightning_pipe.partition.stages.split import BALANCE_MODES, BalanceSpec
from lightning_pipe.runtime.activations.policy import (
    OffloadSpec,
    RecomputeSpec,
    check_offload,
    check_recompute,
    recomputes_nothing,
    uniform_recompute,
)
from lightning_pipe.runtime.activations.recomputation import RECOMPUTE_MODES
from lightning_pipe.runtime.asynchronous.delay_correction import (
    CORRECTIONS,
    DEFAULT_COEFFICIENTS,
    Correction,
    check_delay_correction,
)
from lightning_pipe.runtime.asynchronous.pipemare import DEFAULT_DECAY, DEFAULT_WARMUP
from lightning_pipe.runtime.asynchronous.xpipe import DEFAULT_PREDICTOR, PREDICTORS, Predictor
from lightning_pipe.runtime.loss_weights import LossWeight, check_loss_weight
from lightning_pipe.runtime.microbatch import CHUNKS_PER_STAGE, microbatch_count
from lightning_pipe.runtime.replicas.elastic_averaging import (
    DEFAULT_BETA,
    DEFAULT_PERIOD,
    REPLICAS_SYNC,
    ReplicasSyncMode,
    check_replicas_sync,
)
from lightning_pipe.runtime.topology import DATA_PARALLEL_MODES, DataParallelMode, check_layout_arguments
from lightning_pipe.schedules import (
    DEFAULT_SCHEDULE,
    TRAITS,
    ScheduleName,
    check_virtual_stages,
    get_schedule,
    traits,
)
from lightning_pipe.schedules.text import is_schedule_text
from lightning_pipe.weights import check_weights_argument
from lightning_pipe.weights.names import Rename, check_rename

#: ``plan=``: the layout as given (``None``), or the planner's choice
PlanMode = Literal["auto"]
PLANS: tuple[PlanMode | None, ...] = (None, *get_args(PlanMode))
#: the processes' start methods (Lightning's DDP variants' and multiprocessing's)
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS: tuple[StartMethod, ...] = get_args(StartMethod)
#: The strategy's registered names and their start methods, as Lightning names its DDP variants.
VARIANTS = {"pipeline": "popen", "pipeline_notebook": "fork", "pipeline_spawn": "spawn"}
#: Former names of arguments, still taken with a ``DeprecationWarning``: former name -> name


def option(
    default: Any = None,
    *,
    values: Sequence[Any] | str = (),
    more: str = "",
    unset: str = "",
    cli: bool = True,
    recipe: bool = False,
    internal: bool = False,
    keyword: str = "",
) -> Any:
    """A config field with what the signature, the YAML, the command line and the docs table say of it.

    ``values``: the allowed values (a tuple, the default marked among them) or a text saying them; ``more``:
    text after the tuple; ``unset``: what ``None`` becomes; ``cli=False``: no command-line key (callables);
    ``recipe``: null in the YAML, so a recipe's choice applies; ``internal``: no ``PipelineStrategy`` argument;
    ``keyword``: the type ``PipelineStrategy``'s keyword takes, where narrower than what the field holds.
    The field's docstring (the string under it) says what it means."""
    meta = {"values": values, "more": more, "unset": unset, "cli": cli and not internal, "recipe": recipe}
    meta["keyword"] = keyword  # the type PipelineStrategy's keyword takes, where narrower than the field's
    return field(default=default, metadata={**meta, "internal": internal})


def _several_stages() -> str:
    """Which schedules hold several stages per process by default, and how many (from the traits table)."""
    by_count: dict[int, list[str]] = {}
    for name, t in TRAITS.items():
        if t.virtual_stages > 1:
            by_count.setdefault(t.virtual_stages, []).append(f'`"{name}"`')
    return "; ".join(f"{n} for {', '.join(names[:-1])} and {names[-1]}" for n, names in by_count.items())


def _check(ok: bool, message: str, error: type[Exception] = ValueError) -> None:
    if not ok:
        raise error(message)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class StepsConfig:
    """How each training step runs: the schedule, its micro-batches and what each keeps."""

    schedule: ScheduleName | str = option(
        "1f1b",
        values=tuple(TRAITS),
        more="; or your own in `schedule_text`",
        keyword="ScheduleName",
    )
    """micro-batch order ([Choose a schedule](schedules.md)). GPipe and 1F1B flush after every batch (bubble
    `(p-1)/(m+p-1)`); 1F1B holds at most `p - s` micro-batches' activations on stage `s` instead of `m`. ZB-H1 splits
    each backward into the input gradient and, later, the weight gradient; DualPipeV needs chunks >= 2 x processes;
    Chimera keeps each stage twice. The asynchronous schedules never flush."""
    schedule_text: str | os.PathLike[str] | None = option(
        values="the path of a `.csv` or `.txt` file, or the text itself", unset="a built-in `schedule`"
    )
    """your own schedule, one line of actions per process (torch.distributed.pipelining's CSV cells, as its
    `_dump_csv` writes them): synchronous, validated before training; its stages per process and its micro-batches
    are the text's (`chunks` must agree). See [Write your own schedule](custom-schedule.md)."""
    chunks: int | None = option(values="int >= 1", unset=f"`{CHUNKS_PER_STAGE} * stages`, or a schedule text's count")
    """micro-batches per batch. A batch smaller than `chunks` (an epoch's last batch) is split into as many as it has
    samples; uneven splits are fine."""
    virtual_stages: int | None = option(
        values="int",
        unset=f"the schedule's, {_several_stages()}, else 1",
    )
    """stages per process: the Sequential is split into processes x `virtual_stages` stages by `balance`.
    `"interleaved_1f1b"` and `"interleaved_zero_bubble"` take any value >= 2, `"zbv"` and `"dualpipev"` exactly 2, the
    other schedules 1. `None` becomes the schedule's here, so a `replace` that changes the schedule must give its
    `virtual_stages` too."""
    recompute: RecomputeSpec = option(
        "never",
        values=RECOMPUTE_MODES,
        more=', a list with one of those per pipeline stage, or `"auto"`',
    )
    """activation recomputation per micro-batch (torchgpipe's modes; `checkpoint`: its former name, deprecated). A
    list gives each pipeline stage (processes x `virtual_stages`) its mode; `"auto"` recomputes (`"always"`) on the
    stages that hold more micro-batches in flight at their peak than the last stage (from the schedule), `"never"`
    elsewhere (a list or `"auto"` needs a `balance` that does not price one mode for the whole model: not `"time"` or
    `"memory"`). `plan="auto"` chooses each stage's mode itself, with `offload`, under each rank's memory budget.
    Dropout recomputes the same mask, and the recomputation leaves the buffers the forward updated as it found them,
    so BatchNorm's running statistics and `num_batches_tracked` come out as with `"never"` (BatchNorm itself
    normalises each micro-batch by its own statistics:
    [what differs](quickstart.md#what-differs-from-plain-lightning))."""
    offload: OffloadSpec = option(
        False,
        values='`False`, `True`, int k >= 0, a list with one of those per pipeline stage, or `"auto"`',
    )
    """saved activations moved to host memory between a micro-batch's forward and its backward (VPipe's swap):
    each stage keeps `k` micro-batches' saved tensors on the device and the forwards beyond them put theirs in host
    memory (pinned, on their own CUDA stream, back ahead of the backward), `True` offloads every micro-batch, `False`
    none. A list gives one value per pipeline stage (processes x `virtual_stages`). `"auto"`: the stages that hold more
    micro-batches in flight at their peak than the last stage (from the schedule) keep one fewer than it holds, so they
    hold as many, the others offload nothing. `plan="auto"` chooses it per stage. Exact: training equals training
    without it. See [below](large-models.md#hold-fewer-activations)."""
    gradient_accumulation_fusion: bool = option(True, values=(True, False))
    """fused weight-gradient accumulation: in training steps, each plain `nn.Linear` adds every micro-batch's weight
    gradient into `.grad` inside the matrix product instead of computing each micro-batch's gradient apart and adding
    it (same gradients, less memory traffic; see below)."""
    loss_weight: LossWeight | str | None = option(
        values='`"samples"` (the micro-batch\'s size), or a callable `micro_batch -> count` such as '
        '`lightning_pipe.token_count(labels="labels", ignore_index=-100, shift=True)`',
        unset="the micro-batch's valid labels for a Hugging Face model with a token-mean loss fed dict batches "
        "with `labels`, else its size",
        recipe=True,
    )
    """what each micro-batch's loss averages over: its loss and the means it logs are weighted by its share `n_i / N`
    of the batch's count (with replicas, each replica's by its batch's count too: the global batch's token mean).
    Unset, a Hugging Face LM or token classifier fed dict batches with `labels` is weighted by its labels other than
    -100 (as `token_count`), anything else by its samples; give `token_count` for another token-mean loss. On the
    command line: `strategy.loss_weight={_target_:lightning_pipe.token_count,labels:2,shift:false}`."""
    check_data: bool | int = option(True, values="`True` (default), int N >= 1, `False`")
    """when the stages compare a checksum of the batch each loaded (64 sampled elements per tensor): every step,
    every N steps and the first of each epoch and evaluation loop, or never (shapes only, every step)."""

    def __post_init__(self) -> None:
        if isinstance(self.schedule, os.PathLike):  # a schedule text's path, the former way
            object.__setattr__(self, "schedule", os.fspath(self.schedule))
        if self.schedule_text is None and self.schedule not in TRAITS and is_schedule_text(self.schedule):
            warnings.warn(
                f"PipelineStrategy(schedule={_shown(self.schedule)}) is deprecated for your own schedule: write "
                f"schedule_text={_shown(self.schedule)} (schedule= takes a built-in schedule's name).",
                DeprecationWarning,
                stacklevel=4,
            )
            object.__setattr__(self, "schedule_text", self.schedule)
        if self.schedule_text is not None:
            text = os.fspath(self.schedule_text)
            _check(
                self.schedule in (DEFAULT_SCHEDULE, text),
                f"PipelineStrategy(schedule={self.schedule!r}, schedule_text={_shown(text)}): both name the schedule. "
                "Give schedule= for a built-in one, or schedule_text= for your own.",
            )
            object.__setattr__(self, "schedule_text", text)
            object.__setattr__(self, "schedule", text)  # what the run reads: resolve parses it once
        self.check()
        if self.virtual_stages is None:
            object.__setattr__(self, "virtual_stages", traits(self.schedule).virtual_stages)

    def check(self) -> None:
        schedule, chunks = self.schedule, self.chunks
        get_schedule(schedule)
        text = traits(schedule).text
        _check(
            text is None or chunks is None or chunks == text.num_microbatches,
            f"PipelineStrategy(chunks={chunks}): the schedule text {text.name if text else ''!r} runs "
            f"{text.num_microbatches if text else 0} micro-batches per batch. Give chunks="
            f"{text.num_microbatches if text else 0} or leave it unset.",
        )
        if self.virtual_stages is not None:
            check_virtual_stages(schedule, self.virtual_stages)
        _check(
            chunks is None or _positive_int(chunks),
            f"PipelineStrategy(chunks={chunks!r}): chunks is the number of micro-batches per batch and must be an "
            "integer >= 1.",
        )
        check_recompute(self.recompute)
        _check(
            not traits(schedule).predicts_ahead or recomputes_nothing(self.recompute),
            f"PipelineStrategy(schedule={schedule!r}, recompute={self.recompute!r}): each forward runs on weights "
            "predicted when its step starts, but a recomputed forward would read a later prediction. Use "
            "recompute='never'.",
        )
        check_offload(self.offload)
        check_data = self.check_data
        _check(
            isinstance(check_data, bool) or _positive_int(check_data),
            f"PipelineStrategy(check_data={check_data!r}): give True (compare a checksum of the stages' batches "
            "every step), an integer N >= 1 (every N steps and the first of each epoch) or False (shapes only).",
        )
        check_loss_weight(self.loss_weight)


@dataclass(frozen=True)
class PartitionConfig:
    """What is split into stages, and how its layers are assigned to them."""

    module: str | None = option(
        values="attribute name or dotted path", unset="the module's one `nn.Sequential`", recipe=True
    )
    """what to split: an `nn.Sequential` that the model calls (needed when the module has several top-level ones), or
    an `nn.ModuleList` of blocks that the model's `forward` loops over, the model unchanged (`"model.transformer.h"`;
    see "Bring your own model")."""
    first_stage: Sequence[str] | None = option(
        values="a list of module paths outside the split layers (`[]`: none)",
        unset="found by tracing one step; a Hugging Face model's input embeddings",
    )
    """the modules only the first stage holds and runs (a model's embeddings, `["tok_emb", "pos_emb"]`); on the other
    stages a stand-in returns zeros of their output's shape. See "Bring your own model"."""
    last_stage: Sequence[str] | None = option(
        values="a list of module paths outside the split layers (`[]`: none)",
        unset="found by tracing one step; a Hugging Face model's output embeddings",
    )
    """the modules only the last stage holds and runs (a final norm and head, `["ln_f", "head"]`)."""
    balance: BalanceSpec = option(
        "uniform", values=BALANCE_MODES, more=", or a list of layer counts per stage", recipe=True
    )
    """how the Sequential's layers are assigned to stages, contiguously: equal layer counts, equal parameter counts,
    or the least slowest / largest stage from a profile measured on the device before the split
    (`strategy.profile`)."""
    plan: PlanMode | None = option(values=PLANS)
    """let the planner choose the layout's options: `schedule` (among the synchronous ones), `virtual_stages`,
    `chunks`, `balance`, and per stage `recompute` and `offload` (under each rank's memory budget: a GPU's free
    memory) from a profile of the layers and the measured point-to-point link, before the split (see below);
    `stages` (and so the replicas) stays as given."""
    memory_budget: int | Sequence[int] | None = option(
        values="int bytes for every process, or a list of them with one per process (global rank 0 first)",
        unset="each GPU's free memory; none on CPU processes",
    )
    """the device memory the planner plans each process within (`plan="auto"`): a layout whose process would hold
    more is ranked after those that fit, and a process over it with every activation kept gets, per stage, the
    cheapest mix of offload and recompute that fits (see "Activation memory per stage")."""
    plan_all_layouts: bool = option(False, internal=True)
    """with `plan="auto"`, rank every stages x replicas of the world too (`lightning-pipe plan` prints them; the run
    keeps its own layout)."""

    def check(self) -> None:
        balance = self.balance
        if isinstance(balance, str):
            _check(
                balance in BALANCE_MODES,
                f"PipelineStrategy(balance={balance!r}): unknown balance. Valid: {', '.join(BALANCE_MODES)}, "
                "or a list of layer counts per stage.",
            )
        else:
            _check(
                isinstance(balance, (list, tuple))
                and all(isinstance(n, int) and not isinstance(n, bool) for n in balance),
                f"PipelineStrategy(balance={balance!r}): give one of {', '.join(BALANCE_MODES)}, or a list of layer "
                "counts per stage.",
            )
        _check(
            self.plan in PLANS,
            f"PipelineStrategy(plan={self.plan!r}): valid values are None (use the arguments as given) and 'auto'.",
        )
        for name in ("first_stage", "last_stage"):
            paths = getattr(self, name)
            _check(
                paths is None or (isinstance(paths, (list, tuple)) and all(isinstance(p, str) and p for p in paths)),
                f"PipelineStrategy({name}={paths!r}): give a list of module paths (['tok_emb', 'pos_emb']), [] for "
                "none, or None to find them by tracing one step.",
            )
        both = set(self.first_stage or ()) & set(self.last_stage or ())
        _check(
            not both,
            f"PipelineStrategy(first_stage=..., last_stage=...) both name {sorted(both)}: a module held by one end "
            "stage only is named once (a module the forward runs before and after the split stays on every stage).",
        )
        budget = self.memory_budget
        _check(
            budget is None
            or _positive_int(budget)
            or (isinstance(budget, (list, tuple)) and len(budget) > 0 and all(_positive_int(b) for b in budget)),
            f"PipelineStrategy(memory_budget={budget!r}): give the bytes of device memory for every process as an "
            "integer >= 1, or a list of them with one per process (global rank 0 first).",
        )
        _check(
            budget is None or self.plan == "auto",
            f"PipelineStrategy(memory_budget={budget!r}) is the budget the planner plans within. Give plan='auto' "
            "with it, or leave memory_budget unset.",
        )

    def __post_init__(self) -> None:
        for name in ("first_stage", "last_stage"):
            paths = getattr(self, name)
            if isinstance(paths, Sequence) and not isinstance(paths, str):  # the command line's list as a tuple
                object.__setattr__(self, name, tuple(paths))
        budget = self.memory_budget
        if isinstance(budget, Sequence) and not isinstance(budget, str):  # the command line's list as a list
            object.__setattr__(self, "memory_budget", list(budget))
        self.check()


@dataclass(frozen=True)
class LayoutConfig:
    """Where the stages run: the pipeline's depth, how its replicas share a stage, which rank holds which stage."""

    stages: int | None = option(values="int", unset="one stage per process")
    """pipeline depth p. The world (devices x nodes) must be p x d: d replicas of the pipeline train together, each on
    its own part of every step (see below). A `stages` that does not divide the world fails before training, naming
    both numbers."""
    data_parallel: DataParallelMode = option("replicate", values=DATA_PARALLEL_MODES)
    """how the d replicas share a stage: whole copies with averaged gradients, or FSDP2 shards (see below)."""
    rank_speeds: Sequence[float] | None = option(
        values="a list of positive numbers, one per process, global rank 0 first",
        unset="each rank times a probe on its own device",
    )
    """for `balance="time"` and `plan="auto"` on unequal devices: each stage's measured seconds are divided by the
    speed of the rank holding it, so a slower rank gets less work (`[1.0, 0.5]`: rank 1 at half the speed of rank 0).
    Without it every rank times the same probe; speeds within 10% count as equal. See
    [Unequal devices](layout.md#unequal-devices)."""
    rank_order: Sequence[int] | None = option(
        values="a list of global ranks, each once: the ranks of stage 0's replicas first, then stage 1's"
    )
    """which rank holds which pipeline position (`[0, 2, 1, 3]` on 2 stages x 2 replicas: ranks 0 and 2 hold stage 0).
    `None`: where the ranks' measured speeds or free memory differ by more than 10%, ranks of equal speed share a
    stage, ordered by the predicted step; otherwise rank `r` holds stage `r // replicas`. See
    [Unequal devices](layout.md#unequal-devices)."""

    def __post_init__(self) -> None:
        self.check()
        object.__setattr__(self, "rank_order", check_rank_order(self.rank_order))  # numpy's integers as Python's
        object.__setattr__(self, "rank_speeds", check_rank_speeds(self.rank_speeds))  # numpy's floats as Python's

    def check(self) -> None:
        check_layout_arguments(self.stages, self.data_parallel)
        check_rank_speeds(self.rank_speeds)
        check_rank_order(self.rank_order)


@dataclass(frozen=True)
class ReplicasConfig:
    """How the replicas of a stage stay together."""

    replicas_sync: ReplicasSyncMode = option("allreduce", values=REPLICAS_SYNC)
    """how the replicas of a stage stay together (`data_parallel="replicate"`): their gradients averaged every step
    (they train as one model on the global batch), or AvgPipe's elastic averaging (each steps on its own batches;
    every `replicas_sync_period` steps replicas and a center variable pull towards each other; synchronous schedules
    only; see [Replicas](layout.md#replicas-of-the-pipeline))."""
    replicas_sync_period: int | None = option(values="int >= 1", unset=f"{DEFAULT_PERIOD}")
    """optimizer steps between two averagings (`replicas_sync="elastic"`)."""
    replicas_sync_alpha: float | None = option(
        values="float in (0, 1), replicas x alpha <= 1", unset=f"{DEFAULT_BETA} / replicas"
    )
    """the elastic coefficient (`replicas_sync="elastic"`)."""

    def check(self) -> None:
        check_replicas_sync(self.replicas_sync, self.replicas_sync_period, self.replicas_sync_alpha)

    def __post_init__(self) -> None:
        self.check()


@dataclass(frozen=True)
class AsynchronousConfig:
    """The options of the asynchronous schedules' rules (PipeMare's and XPipe's, the delay corrections)."""

    pipemare_warmup: int | None = option(
        values="int K >= 0", unset=f'{DEFAULT_WARMUP} under `"pipemare"`, off under the PipeDream schedules'
    )
    """PipeMare's learning-rate rescheduling for the asynchronous schedules: stage i's step size starts at
    `lr / tau_i` and returns to yours over K optimizer updates (`lr * tau_i ** -(1 - min(k / K, 1))` at update k);
    0 turns it off (see below)."""
    pipemare_correction: bool | None = option(values=(None, True, False), unset='on under `"pipemare"`')
    """PipeMare's discrepancy correction: each backward runs on the weights predicted for its forward's moment from a
    velocity of the updates (`"pipemare"` only; needs `recompute="never"`). `False`: backwards on the current
    weights."""
    pipemare_decay: float | None = option(values="float D in (0, 1)", unset=f"{DEFAULT_DECAY}")
    """the velocity decay D of PipeMare's correction: `gamma_i = D ** (1 / tau_i)` (`"pipemare"` with the correction
    on): how much
    of the velocity is left after one delay of `tau_i` updates; larger values average the updates over more steps."""
    xpipe_predictor: Predictor | None = option(values=PREDICTORS, unset=f'`"{DEFAULT_PREDICTOR}"` under `"xpipe"`')
    """how `"xpipe"` predicts the weights its forwards and backwards run on: `tau_i` updates ahead, the optimizer's
    last update times `tau_i` (any optimizer), Adam's moments, or SGD's momentum buffer (see
    [Schedules](schedules.md#the-asynchronous-schedules))."""
    delay_correction: Correction | None = option(values=(None, *CORRECTIONS), unset="off")
    """a correction of the gradient applied late, before your optimizer steps with it: `"nesterov"`, the Nesterov
    method's NAdam step (its beta1: `delay_correction_coefficient`) over the stashed gradients (`"pipedream"`,
    `"pipedream_2bw"`, `"wpipe"`; with plain SGD at an Adam-sized lr, other optimizers refused), or
    `"error_feedback"`, the one-step delay's error fed back (`"pipedream_2bw"`; with Adam or AdamW, SGD refused); see
    [Schedules](schedules.md#delay-corrections)."""
    delay_correction_coefficient: float | None = option(
        values="float in [0, 1)",
        unset=f'{DEFAULT_COEFFICIENTS["nesterov"]} under `"nesterov"` (beta1), '
        f'{DEFAULT_COEFFICIENTS["error_feedback"]} under `"error_feedback"` (beta)',
    )
    """the delay correction's coefficient: NAdam's beta1, or the share beta of the error fed back."""

    def check(self) -> None:
        warmup, correction, decay, predictor = (
            self.pipemare_warmup,
            self.pipemare_correction,
            self.pipemare_decay,
            self.xpipe_predictor,
        )
        _check(
            warmup is None or (isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= 0),
            f"PipelineStrategy(pipemare_warmup={warmup!r}): give the number of optimizer updates K >= 0 over which "
            "the learning-rate rescheduling returns to your learning rate (0: off, None: the schedule's default).",
        )
        _check(
            correction is None or isinstance(correction, bool),
            f"PipelineStrategy(pipemare_correction={correction!r}): give True, False or None.",
        )
        _check(
            decay is None or (not isinstance(decay, bool) and isinstance(decay, (int, float)) and 0.0 < decay < 1.0),
            f"PipelineStrategy(pipemare_decay={decay!r}): give the velocity's decay over one delay, a number "
            f"strictly between 0 and 1 (None: {DEFAULT_DECAY}).",
        )
        _check(
            predictor is None or predictor in PREDICTORS,
            f"PipelineStrategy(xpipe_predictor={predictor!r}) sets how schedule='xpipe' predicts its weights; valid: "
            f"{', '.join(PREDICTORS)}. Use schedule='xpipe' with one of those, or leave xpipe_predictor unset.",
        )
        _check(
            self.delay_correction is None or self.delay_correction in CORRECTIONS,
            f"PipelineStrategy(delay_correction={self.delay_correction!r}) is not a delay correction; valid: "
            f"{', '.join(CORRECTIONS)} (or None: off).",
        )

    def __post_init__(self) -> None:
        self.check()


@dataclass(frozen=True)
class LoadingConfig:
    """Where the stages' weights come from, and how a module built on the meta device is initialised."""

    weights: str | Path | None = option(values="path")
    """full weights to start from: a `state_dict` saved with `torch.save` (`.pt`/`.pth`), a Lightning `.ckpt`, a
    `.safetensors` file, a lightning-pipe checkpoint directory or a directory written by Hugging Face `save_pretrained`
    (sharded or not); each rank reads only its stage (see below). Hydra: `strategy.weights=PATH`."""
    init: Callable[[nn.Module], None] | None = option(values="callable `init(module) -> None`", cli=False)
    """for a module built in `configure_model()`: initialises one module's own tensors, called on every module,
    children before parents, seeded per layer; replaces the default (`PreTrainedModel._init_weights`, else
    `reset_parameters()`)."""
    rename: Rename | None = option(values="mapping or callable", cli=False)
    """for `weights=`: file-name prefixes to module-name prefixes (`{"transformer.": "backbone."}`), or a callable
    file name -> module name (`None` leaves a tensor out)."""

    def check(self) -> None:
        check_weights_argument(self.weights)
        check_rename(self.rename)
        _check(
            self.init is None or callable(self.init),
            f"PipelineStrategy(init={self.init!r}): give a callable init(module) -> None that sets the module's own "
            "tensors.",
            TypeError,
        )

    def __post_init__(self) -> None:
        self.check()


@dataclass(frozen=True)
class LaunchConfig:
    """How the processes start, and start again after a lost node."""

    start_method: StartMethod = option("popen", values=START_METHODS)
    """how processes start, as in `DDPStrategy`: `"popen"` for scripts and the command line, `"spawn"` or `"fork"` in
    notebooks and tests."""
    elastic: bool | str | Path = option(False, values="`False` (default), `True`, a folder")
    """resume by itself when torchrun's elastic agent restarts the run after a lost node: from the newest complete
    checkpoint of the `ModelCheckpoint`'s `dirpath` (`True`) or of the folder, under the layout that fits the new
    world, keeping the global batch (see [Elastic runs](elastic.md))."""

    def check(self) -> None:
        _check(
            isinstance(self.elastic, (bool, str, Path)) and self.elastic != "",
            f"PipelineStrategy(elastic={self.elastic!r}): give True (watch the ModelCheckpoint callbacks' dirpath), "
            "the folder of the checkpoints to resume from, or False (off).",
        )
        _check(
            self.start_method in START_METHODS,
            f"PipelineStrategy(start_method={self.start_method!r}): valid values are {', '.join(START_METHODS)}.",
        )

    def __post_init__(self) -> None:
        self.check()


@dataclass(frozen=True, init=False)
class PipelineConfig:
    """The arguments of a pipeline run, by concern; ``PipelineConfig(schedule="gpipe", chunks=4)`` takes them flat.

    Each group checks its own fields when it is made; :meth:`check` then checks what spans groups. A flat
    name reads through its group (``config.schedule`` is ``config.steps.schedule``).
    """

    steps: StepsConfig = field(default_factory=StepsConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    replicas: ReplicasConfig = field(default_factory=ReplicasConfig)
    asynchronous: AsynchronousConfig = field(default_factory=AsynchronousConfig)
    loading: LoadingConfig = field(default_factory=LoadingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def __init__(self, **values: Any) -> None:
        """Groups by their names (``steps=StepsConfig(...)``) or arguments by theirs (``schedule="gpipe"``)."""
        groups = {f.name: f for f in dataclasses.fields(self)}
        leaves = argument_groups(type(self))
        unknown = [name for name in values if name not in groups and name not in leaves]
        if unknown:
            raise TypeError(unknown_arguments(type(self).__name__, unknown, [*groups, *leaves]))
        for name in groups:
            given = {leaf: value for leaf, value in values.items() if leaves.get(leaf) == name}
            value = values.get(name)
            if value is None:
                value = _group_type(type(self), name)(**given)
            elif given:
                value = dataclasses.replace(value, **given)
            object.__setattr__(self, name, value)
        self.check()

    # the flat reads, typed: written by `python -m lightning_pipe.config_files` from the groups' fields
    @property
    def schedule(self) -> ScheduleName | str:
        return self.steps.schedule

    @property
    def schedule_text(self) -> str | os.PathLike[str] | None:
        return self.steps.schedule_text

    @property
    def chunks(self) -> int | None:
        return self.steps.chunks

    @property
    def virtual_stages(self) -> int | None:
        return self.steps.virtual_stages

    @property
    def recompute(self) -> RecomputeSpec:
        return self.steps.recompute

    @property
    def offload(self) -> OffloadSpec:
        return self.steps.offload

    @property
    def gradient_accumulation_fusion(self) -> bool:
        return self.steps.gradient_accumulation_fusion

    @property
    def loss_weight(self) -> LossWeight | str | None:
        return self.steps.loss_weight

    @property
    def check_data(self) -> bool | int:
        return self.steps.check_data

    @property
    def module(self) -> str | None:
        return self.partition.module

    @property
    def first_stage(self) -> Sequence[str] | None:
        return self.partition.first_stage

    @property
    def last_stage(self) -> Sequence[str] | None:
        return self.partition.last_stage

    @property
    def balance(self) -> BalanceSpec:
        return self.partition.balance

    @property
    def plan(self) -> PlanMode | None:
        return self.partition.plan

    @property
    def memory_budget(self) -> int | Sequence[int] | None:
        return self.partition.memory_budget

    @property
    def plan_all_layouts(self) -> bool:
        return self.partition.plan_all_layouts

    @property
    def stages(self) -> int | None:
        return self.layout.stages

    @property
    def data_parallel(self) -> DataParallelMode:
        return self.layout.data_parallel

    @property
    def rank_speeds(self) -> Sequence[float] | None:
        return self.layout.rank_speeds

    @property
    def rank_order(self) -> Sequence[int] | None:
        return self.layout.rank_order

    @property
    def replicas_sync(self) -> ReplicasSyncMode:
        return self.replicas.replicas_sync

    @property
    def replicas_sync_period(self) -> int | None:
        return self.replicas.replicas_sync_period

    @property
    def replicas_sync_alpha(self) -> float | None:
        return self.replicas.replicas_sync_alpha

    @property
    def pipemare_warmup(self) -> int | None:
        return self.asynchronous.pipemare_warmup

    @property
    def pipemare_correction(self) -> bool | None:
        return self.asynchronous.pipemare_correction

    @property
    def pipemare_decay(self) -> float | None:
        return self.asynchronous.pipemare_decay

    @property
    def xpipe_predictor(self) -> Predictor | None:
        return self.asynchronous.xpipe_predictor

    @property
    def delay_correction(self) -> Correction | None:
        return self.asynchronous.delay_correction

    @property
    def delay_correction_coefficient(self) -> float | None:
        return self.asynchronous.delay_correction_coefficient

    @property
    def weights(self) -> str | Path | None:
        return self.loading.weights

    @property
    def init(self) -> Callable[[nn.Module], None] | None:
        return self.loading.init

    @property
    def rename(self) -> Rename | None:
        return self.loading.rename

    @property
    def start_method(self) -> StartMethod:
        return self.launch.start_method

    @property
    def elastic(self) -> bool | str | Path:
        return self.launch.elastic

    # end of the flat reads

    if not typing.TYPE_CHECKING:  # the type checker sees only the typed reads above

        def __getattr__(self, name: str) -> Any:
            """A flat read of a group that a subclass adds (its own arguments have no typed read above)."""
            group = argument_groups(type(self)).get(name)
            if group is None:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            return getattr(object.__getattribute__(self, group), name)

    def check(self) -> None:
        """What spans groups: a text schedule and the planner, measured speeds and the balance, elastic averaging
        and the layout and schedule, the asynchronous rules' options and the schedule."""
        check_text_schedule(self)
        check_stage_recompute(self)
        if self.rank_speeds is not None and self.balance != "time" and self.plan != "auto":
            raise ValueError(
                f"PipelineStrategy(rank_speeds={self.rank_speeds!r}, balance={self.balance!r}): the speeds weight the "
                "measured split, balance='time' (or plan='auto'). Give balance='time', or leave rank_speeds unset."
            )
        check_elastic_averaging(self)
        check_pipemare_options(self)
        check_delay_correction(self.delay_correction, self.delay_correction_coefficient, self.schedule)

    @property
    def checkpoint(self) -> str:
        """The former name of :attr:`recompute` (activation recomputation), kept for reading."""
        return str(self.recompute)

    def replace(self, **changes: Any) -> PipelineConfig:
        """A copy with ``changes`` (flat names or groups), checked like the original."""
        leaves = argument_groups(type(self))
        groups: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        groups.update({name: value for name, value in changes.items() if name not in leaves})  # unknown: refused
        for name in set(groups):
            given = {leaf: value for leaf, value in changes.items() if leaves.get(leaf) == name}
            if given:
                groups[name] = dataclasses.replace(groups[name], **given)
        return type(self)(**groups)

    def num_microbatches(self, num_stages: int) -> int:
        """Micro-batches per batch for a pipeline of ``num_stages`` (see
        :func:`~lightning_pipe.runtime.microbatch.microbatch_count`)."""
        return microbatch_count(self.chunks, traits(self.schedule), num_stages)


def _group_type(config: type, name: str) -> type[Any]:
    return dict(_group_types(config))[name]


_GROUPS: dict[type, tuple[tuple[str, type], ...]] = {}  # a config class's groups: (name, type), in order
_LEAVES: dict[type, dict[str, str]] = {}  # a config class's arguments: name -> group name


def _group_types(config: type) -> tuple[tuple[str, type], ...]:
    if config not in _GROUPS:
        hints = typing.get_type_hints(config)
        _GROUPS[config] = tuple((f.name, hints[f.name]) for f in dataclasses.fields(config))
    return _GROUPS[config]


def argument_groups(config: type = PipelineConfig) -> dict[str, str]:
    """Every argument's name -> the name of its group in ``config``."""
    if config not in _LEAVES:
        _LEAVES[config] = {f.name: name for name, group in _group_types(config) for f in dataclasses.fields(group)}
    return _LEAVES[config]


class Argument(NamedTuple):
    """One argument as the signature, the YAML, the command line and the docs table show it."""

    name: str
    group: str
    default: Any
    annotation: Any
    doc: str
    values: Sequence[Any] | str
    more: str
    unset: str
    cli: bool
    recipe: bool


def group_fields(
    config: type = PipelineConfig, internal: bool = True, keyword: bool = False
) -> Iterator[tuple[str, str]]:
    """Every field of ``config``'s groups by name, with its annotation as written in the source (``internal``:
    with the fields that are no argument; ``keyword``: the type a user passes, where it is narrower than what
    the field holds once checked, as ``schedule``'s name)."""
    for _, group in _group_types(config):
        for f in dataclasses.fields(group):
            if internal or not f.metadata.get("internal"):
                written = f.type if isinstance(f.type, str) else inspect.formatannotation(f.type)
                yield f.name, (f.metadata.get("keyword") or written) if keyword else written


def _shown(value: str) -> str:
    """A schedule text's path as written, or a text's first line (a whole text is too long for a message)."""
    return repr(value) if "\n" not in value else repr(value.splitlines()[0] + "\n...")


def arguments(config: type = PipelineConfig, internal: bool = False) -> Iterator[Argument]:
    """The arguments of ``config``, group by group (``internal``: with the fields that are no argument)."""
    for name, group in _group_types(config):
        hints, docs = typing.get_type_hints(group), field_docs(group)
        for f in dataclasses.fields(group):
            meta: Mapping[str, Any] = f.metadata
            if meta.get("internal") and not internal:
                continue
            yield Argument(
                f.name,
                name,
                f.default,
                hints.get(f.name, f.type),
                docs.get(f.name, ""),
                meta.get("values", ()),
                meta.get("more", ""),
                meta.get("unset", ""),
                meta.get("cli", True),
                meta.get("recipe", False),
            )


_DOCS: dict[type, dict[str, str]] = {}


def field_docs(group: type) -> dict[str, str]:
    """The string under each field of ``group`` (torchtitan's field docstrings), read from its source."""
    if group in _DOCS:
        return _DOCS[group]
    docs = _DOCS[group] = {}
    for cls in reversed(group.__mro__[:-1]):
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
        except (OSError, TypeError):  # made without a source file (dataclasses.make_dataclass)
            continue
        assert isinstance(body, ast.ClassDef)
        for statement, after in zip(body.body, body.body[1:]):
            named = isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
            if named and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                assert isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                docs[statement.target.id] = inspect.cleandoc(str(after.value.value))
    return docs


def cli_keys(config: type = PipelineConfig) -> tuple[str, ...]:
    """The arguments a command line gives as ``strategy.<key>`` (not the callables)."""
    return tuple(a.name for a in arguments(config) if a.cli)


def unknown_arguments(owner: str, unknown: Sequence[str], valid: Sequence[str]) -> str:
    """``owner(name=...)``: no such argument, with the close matches to ``name``."""
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=3)
        parts.append(f"{name!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""))
    return f"{owner}() got unexpected keyword arguments: {', '.join(parts)}. Valid: {', '.join(valid)}."


def split_arguments(
    values: Mapping[str, Any], others: Sequence[str], config: type[PipelineConfig] = PipelineConfig
) -> tuple[PipelineConfig, dict[str, Any]]:
    """``PipelineStrategy(**values)``: the config from its arguments (a former name warns), and the
    arguments named in ``others`` (the process strategy's); any other name raises a ``TypeError``."""
    names = [a.name for a in arguments(config)]
    unknown = [k for k in values if k not in names and k not in others and k not in DEPRECATED]
    if unknown:
        raise TypeError(unknown_arguments("PipelineStrategy", unknown, [*names, *others]))
    mine = {k: v for k, v in values.items() if k in names}
    mine["recompute"] = recompute_mode(mine.pop("recompute", None), values.get("checkpoint"))
    return config(**mine), {k: v for k, v in values.items() if k in others}


def strategy_signature(
    base: Callable[..., Any], config: type[PipelineConfig] = PipelineConfig, self: bool = False
) -> inspect.Signature:
    """``PipelineStrategy``'s signature: every argument of ``config`` with its default (keyword-only), then
    ``base``'s own (the process strategy's)."""
    own = [
        inspect.Parameter(a.name, inspect.Parameter.KEYWORD_ONLY, default=a.default, annotation=a.annotation)
        for a in arguments(config)
    ]
    rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in inspect.signature(base).parameters.values()]
    first = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] if self else []
    return inspect.Signature([*first, *own, *(p for p in rest if p.name != "self")], return_annotation=None)


def recompute_mode(recompute: str | None, checkpoint: str | None) -> str:
    """``recompute=``, or its former name ``checkpoint=`` with a ``DeprecationWarning`` (the name
    collided with saved checkpoints); ``"never"`` when neither is given."""
    if checkpoint is None:
        return "never" if recompute is None else recompute
    if recompute is not None and recompute != checkpoint:
        raise ValueError(
            f"PipelineStrategy(recompute={recompute!r}, checkpoint={checkpoint!r}): both name activation "
            "recomputation; give recompute= only (checkpoint= is its deprecated former name)."
        )
    warnings.warn(
        f"PipelineStrategy(checkpoint={checkpoint!r}) is deprecated: write recompute={checkpoint!r} (activation "
        "recomputation; checkpoint= will be removed in a later release).",
        DeprecationWarning,
        stacklevel=4,
    )
    return checkpoint


def check_text_schedule(config: PipelineConfig) -> None:
    """A schedule handed in as text fixes the schedule: the planner, which chooses one, cannot run it (its
    micro-batches are checked with ``chunks``, in :meth:`StepsConfig.check`)."""
    text = traits(config.schedule).text
    if text is not None and config.plan is not None:
        raise ValueError(
            f"PipelineStrategy(plan={config.plan!r}) chooses the schedule, and schedule_text= hands one in "
            f"({text.name!r}). Leave plan unset to run the text, or give a schedule's name to plan."
        )


def check_stage_recompute(config: PipelineConfig) -> None:
    """A recompute mode per stage (a list, or ``"auto"``) next to what prices one mode for the whole model."""
    if uniform_recompute(config.recompute) is not None:
        return
    if config.plan == "auto":
        return  # the planner chooses each stage's recompute mode and offload, with the split
    if config.balance in ("time", "memory"):
        raise ValueError(
            f"PipelineStrategy(balance={config.balance!r}, recompute={config.recompute!r}): the measured balance "
            "prices one recompute mode for the whole model. Give one mode, or balance='uniform', 'parameters' "
            "or a list of layer counts."
        )


def check_elastic_averaging(config: PipelineConfig) -> None:
    """``replicas_sync="elastic"``: whole replicas that each step on their own, synchronously (the
    layout's replica count is checked once known, in
    :func:`~lightning_pipe.runtime.replicas.elastic_averaging.resolve_alpha`)."""
    if config.replicas_sync != "elastic":
        return
    if config.data_parallel != "replicate":
        raise ValueError(
            f"PipelineStrategy(replicas_sync='elastic', data_parallel={config.data_parallel!r}): elastic averaging "
            "pulls whole replicas of each stage together, and sharded replicas hold parts of one. Use "
            "data_parallel='replicate', or replicas_sync='allreduce'."
        )
    if traits(config.schedule).asynchronous:
        raise ValueError(
            f"PipelineStrategy(replicas_sync='elastic', schedule={config.schedule!r}): elastic averaging runs with "
            "the synchronous schedules; an asynchronous one keeps weight versions that the averaging would not "
            "update. Use a synchronous schedule (such as '1f1b' or 'gpipe'), or replicas_sync='allreduce'."
        )


def check_pipemare_options(config: PipelineConfig) -> None:
    """PipeMare's switches against the schedule: rescheduling for the asynchronous schedules, correction for
    ``pipemare``; XPipe's predictor for ``xpipe`` (each value's own range: :meth:`AsynchronousConfig.check`)."""
    warmup, correction, schedule = config.pipemare_warmup, config.pipemare_correction, config.schedule
    if warmup and not traits(schedule).asynchronous:
        raise ValueError(
            f"PipelineStrategy(pipemare_warmup={warmup}) rescales the step size of asynchronous schedules, whose "
            f"gradients arrive late; schedule={schedule!r} is synchronous. Use schedule='pipemare', 'pipedream' "
            "or 'pipedream_2bw', or leave pipemare_warmup unset."
        )
    if correction and not traits(schedule).predicts_weights:
        raise ValueError(
            f"PipelineStrategy(pipemare_correction=True) predicts the forward's weights for backwards that run on "
            f"newer ones; schedule={schedule!r} "
            + (
                "keeps the forward's weights for its backwards already"
                if traits(schedule).stashes_weights
                else "predicts its forwards' and backwards' weights ahead already"
                if traits(schedule).predicts_ahead
                else "has no such backwards"
            )
            + ". Use schedule='pipemare', or leave pipemare_correction unset."
        )
    decay = config.pipemare_decay
    if decay is not None and (not traits(schedule).predicts_weights or correction is False):
        raise ValueError(
            f"PipelineStrategy(pipemare_decay={decay}) sets the velocity of PipeMare's discrepancy correction, "
            f"which is off here (schedule={schedule!r}, pipemare_correction={correction!r}). Use "
            "schedule='pipemare' with the correction on, or leave pipemare_decay unset."
        )
    predictor = config.xpipe_predictor
    if predictor is not None and not traits(schedule).predicts_ahead:
        raise ValueError(
            f"PipelineStrategy(xpipe_predictor={predictor!r}) sets how schedule='xpipe' predicts its weights; "
            f"schedule={schedule!r} does not. Use schedule='xpipe' with one of {', '.join(PREDICTORS)}, or leave "
            "xpipe_predictor unset."
        )
    if traits(schedule).predicts_weights and correction is not False and not recomputes_nothing(config.recompute):
        raise ValueError(
            f"PipelineStrategy(schedule='pipemare', recompute={config.recompute!r}): discrepancy correction gives each "
            "backward the weights predicted for its forward, but a recomputed forward reads the current ones. Use "
            "recompute='never', or pipemare_correction=False."
        )
    _check_offload_schedule(config, correction)


def _check_offload_schedule(config: PipelineConfig, correction: bool | None) -> None:
    """PipeMare's correction swaps the weights in its own saved-tensor hooks, which offload's would replace;
    FSDP2 frees and gathers a sharded stage's weights around each micro-batch, which offload cannot tell yet."""
    if config.data_parallel == "shard" and config.offload not in (None, False):
        raise ValueError(
            f"PipelineStrategy(data_parallel='shard', offload={config.offload!r}): FSDP2 frees and gathers the "
            "sharded weights around each micro-batch, and offload's saved-tensor hooks cannot tell them from "
            "activations yet. Use offload=False, or data_parallel='replicate'."
        )
    if traits(config.schedule).predicts_weights and correction is not False and config.offload not in (None, False):
        raise ValueError(
            f"PipelineStrategy(schedule='pipemare', offload={config.offload!r}): discrepancy correction gives each "
            "backward its predicted weights through saved-tensor hooks, which offload cannot share. Use "
            "offload=False, or pipemare_correction=False."
        )


def register_variants(strategy: Callable[..., Any], registry: Any) -> None:
    """Register ``strategy`` (the class, or what builds it) under each name of :data:`VARIANTS` with its
    start method (again: a no-op). Here, free of Lightning: the package registers them as soon as Lightning
    is imported, whatever module of the package is being imported then."""
    for name, start_method in VARIANTS.items():
        if name not in registry:
            description = f"Pipeline model parallelism (lightning-pipe), start_method={start_method!r}"
            registry.register(name, strategy, description=description, start_method=start_method)
