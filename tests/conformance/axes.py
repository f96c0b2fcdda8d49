"""The conformance matrix's axes and cells, as values (no torch, no processes).

A cell is one schedule x one lifecycle event x one layout x one model. Every axis is a tuple below;
schedules are the rows of the traits table, so a new schedule, event, layout or model joins every
cell by being added to its axis. What a schedule's traits refuse is predicted here from the traits
alone (:func:`refusal`): the runner checks the run is refused before training, with that sentence.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from lightning_pipe.schedules.traits import TRAITS, ScheduleTraits, traits

#: torch.distributed.pipelining's own schedule, given as the text its ``_dump_csv`` writes (built at test time
#: from torch's class, at the cell's processes and micro-batches: two stages per process, I and W split)
TORCH_TEXT = "torch_text"
TORCH_CLASS = "ScheduleInterleavedZeroBubble"


def _torch_has_it() -> bool:
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:
        return False
    return hasattr(schedules, TORCH_CLASS)


#: every schedule the strategy runs, in the table's order, then torch's own text (where this torch has it)
SCHEDULES: tuple[str, ...] = (*TRAITS, *((TORCH_TEXT,) if _torch_has_it() else ()))


def microbatches(schedule: str, positions: int) -> int:
    """A cell's micro-batches: 2 per stage (the strategy's default: a stage holds several at once), more where
    a schedule needs more."""
    t = TRAITS.get(schedule)
    return max(2 * positions, t.min_chunks(positions) if t is not None and t.min_chunks else 1)


@functools.cache
def torch_text(positions: int, chunks: int) -> str:
    from tests.torch_texts import torch_text as written

    return written(TORCH_CLASS, positions, chunks)


def schedule_argument(schedule: str, positions: int) -> str:
    """What the cell gives as ``schedule=``: a built-in's name, or torch's text for the cell's processes."""
    return torch_text(positions, microbatches(schedule, positions)) if schedule == TORCH_TEXT else schedule


def schedule_traits(schedule: str, positions: int) -> ScheduleTraits:
    return traits(schedule_argument(schedule, positions))


@dataclass(frozen=True)
class Event:
    """Something that happens to a fit. ``rule`` changes the update rule (plain Lightning runs it too);
    ``interrupt`` must not change the weights: the run with it is compared with the run without."""

    name: str
    #: Trainer options that change the update rule (the oracle runs them as well)
    rule: dict = field(default_factory=dict, hash=False, compare=False)
    #: "resume_epoch" (save at an epoch end, resume), "resume_mid" (save mid-epoch, run on; resume from
    #: that save), "stop_mid" (max_steps stops mid-epoch, resume), "save_every_step", "validate_mid",
    #: or None
    interrupt: str | None = None
    #: an LR scheduler stepping every step
    scheduler: bool = False
    #: predict and test after the fit, against one process's predict and test on the fitted weights
    predict_test: bool = False
    #: strategy options that must not change the weights (plain Lightning runs without them)
    strategy: dict = field(default_factory=dict, hash=False, compare=False)


EVENTS: tuple[Event, ...] = (
    Event("fit_predict_test", predict_test=True),
    Event("resume_epoch", interrupt="resume_epoch"),
    Event("resume_mid", interrupt="resume_mid"),
    Event("stop_mid_resume", interrupt="stop_mid"),
    Event("save_every_step", interrupt="save_every_step"),
    Event("validate_mid", interrupt="validate_mid"),
    Event("accumulate", rule={"accumulate_grad_batches": 2}),
    Event("clip_norm", rule={"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}),
    Event("clip_value", rule={"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    Event("lr_every_step", scheduler=True),
    Event("offload", strategy={"offload": True}),  # every micro-batch's saved activations to host memory
)


@dataclass(frozen=True)
class Layout:
    """Where the stages run. ``devices`` processes as ``stages`` x replicas; ``restart_on`` a list of
    world sizes the run is restarted on (elastic, from the newest checkpoint of the watched folder)."""

    name: str
    devices: int
    stages: int | None = None
    data_parallel: str = "replicate"
    rank_order: tuple[int, ...] | None = None
    virtual_stages: int | None = None
    replicas_sync: str | None = None
    restart_on: tuple[int, ...] = ()
    #: the training data shuffled (each replica's share drawn by the sampler's seed)
    shuffle: bool = False

    @property
    def replicas(self) -> int:
        return self.devices // (self.stages or self.devices)

    @property
    def positions(self) -> int:
        return self.stages or self.devices

    @property
    def elastic(self) -> bool:
        return bool(self.restart_on)


LAYOUTS: tuple[Layout, ...] = (
    Layout("p2", 2),
    Layout("p3", 3),
    Layout("2x2_replicate", 4, stages=2),
    Layout("2x2_shard", 4, stages=2, data_parallel="shard"),
    Layout("permuted", 2, rank_order=(1, 0)),
    Layout("avgpipe_permuted", 4, stages=2, rank_order=(1, 0, 3, 2), replicas_sync="elastic"),
    Layout("virtual3", 2, virtual_stages=3),
    Layout("elastic_shrink", 4, stages=2, restart_on=(2,), shuffle=True),
    Layout("elastic_grow", 4, stages=2, restart_on=(2, 4), shuffle=True),
)


@dataclass(frozen=True)
class Model:
    """A model users bring. ``module``: a block container the pipeline splits (``module=``)."""

    name: str
    module: str | None = None
    tied: bool = False
    outside: bool = False  # trainable parameters outside the split Sequential (no ``module=``)
    token_count: bool = False
    skips: bool = False  # skip connections across stages (``lightning_pipe.skips``' stash and pop)
    #: a Hugging Face model whose loss reads what transformers records of every block (its hidden states)
    records: bool = False
    #: the optimizer: Adam hardly reacts to a constant factor on the gradient, plain SGD does
    optimizer: str = "adam"
    #: dropout, one layer on stage 0 and two on stage 1, so that every rank's random state differs: its masks are
    #: each layout's own, so its oracle is the same run uninterrupted (every rank's restored random state)
    dropout: bool = False
    #: the module's own code around the call: a forward that loops over the Sequential, parameter groups built
    #: by position (``enumerate(self.layers)``) and a penalty over parameters (``lightning_pipe.parameter_penalty``)
    around: bool = False
    #: torch's own ``nn.TransformerEncoder`` (its layers split with ``module=``), with a padding mask: in
    #: evaluation its fast path runs, nested tensors crossing the stages
    torch_transformer: bool = False


MODELS: tuple[Model, ...] = (
    Model("sequential"),
    Model("blocks", module="blocks"),
    Model("tied", tied=True),
    Model("frozen", module="blocks"),  # a frozen norm outside the container, AdamW with weight decay
    Model("outside", outside=True),
    Model("zero_token", token_count=True),
    Model("skips", skips=True),
    Model("records", module="bert.encoder.layer", records=True),
    Model("sgd", optimizer="sgd"),
    Model("dropout", dropout=True),
    Model("around", optimizer="sgd", around=True),
    Model("torch_encoder", module="encoder.layers", torch_transformer=True),
)

AXES = {"schedule": SCHEDULES, "event": EVENTS, "layout": LAYOUTS, "model": MODELS}


@dataclass(frozen=True)
class Cell:
    schedule: str
    event: Event
    layout: Layout
    model: Model

    @property
    def id(self) -> str:
        return f"{self.schedule}/{self.event.name}/{self.layout.name}/{self.model.name}"

    @property
    def traits(self) -> ScheduleTraits:
        return schedule_traits(self.schedule, self.layout.positions)


#: the refusal of values recorded by blocks under a schedule that does not carry them: the only one that
#: comes in the first training step's forward (what the model records is known then), before any update
RECORDS_REFUSED = r"does not carry them yet"


def refusal(cell: Cell) -> str | None:
    """The sentences (a regular expression, any of them) the strategy must refuse ``cell`` with before
    training, as the schedule's traits say; None where the traits allow the cell."""
    t, layout, model = cell.traits, cell.layout, cell.model
    sentences = []
    if layout.virtual_stages is not None and not t.interleaved:
        sentences.append(r"virtual_stages")
    if t.even_stages and layout.positions % 2:
        sentences.append(r"even number")
    if layout.replicas > 1 and not t.replicas:
        sentences.append(r"replica")
    if model.module is not None and not t.block_containers:
        sentences.append(r"block container")
    if model.tied and t.refuses_ties:
        sentences.append(r"tied")
    if model.records and not t.records_cross:  # refused in the first forward, before any weight changes
        sentences.append(RECORDS_REFUSED)
    if layout.replicas > 1 and layout.data_parallel == "shard":
        if t.asynchronous:
            sentences.append(r"weight versions, which sharded weights do not have")
        if model.tied and t.placement == "v":  # both ends of the tie on one process: two FSDP2 units
            sentences.append(r"tied across stages")
    if layout.data_parallel == "shard" and cell.event.strategy.get("offload"):
        sentences.append(r"offload's saved-tensor hooks cannot tell them")
    if layout.replicas_sync == "elastic" and t.asynchronous:
        sentences.append(r"elastic averaging runs with the synchronous schedules")
    if t.predicts_weights and cell.event.strategy.get("offload"):  # PipeMare's correction has saved-tensor hooks
        sentences.append(r"offload cannot share")
    if t.asynchronous and cell.event.rule.get("accumulate_grad_batches", 1) > 1:
        sentences.append(r"accumulate_grad_batches must be 1")
    return "|".join(sentences) or None


def open_defect(cell: Cell) -> str | None:
    """Why ``cell`` is known to fail today (found by the matrix, not yet fixed), or None; the test
    marks it ``xfail(strict=True)``, so the fix makes it fail until its line here goes."""
    del cell  # none is open today: a line per defect, ``if <its cells>: return "<why>"``, until its fix
    return None


#: the events that save, stop and resume
RESUMES = ("resume_epoch", "resume_mid", "stop_mid")


def excluded(cell: Cell) -> str | None:
    """Why a combination is no cell at all (not a refusal: nothing to run), or None."""
    if cell.layout.elastic and cell.event.interrupt in RESUMES:
        return "an elastic layout is itself a resume"
    if cell.layout.elastic and cell.traits.asynchronous:
        return "no oracle: an asynchronous rule's delays and batch change with the world"
    if cell.model.dropout and (cell.event.interrupt is None or cell.layout.elastic or cell.layout.rank_order):
        return "no oracle: dropout's masks are each layout's own, so only an interruption compares (with the same run)"
    if cell.model.dropout and cell.event.interrupt == "validate_mid":
        # a DataLoader's iterator draws its base seed from the global random state, in plain Lightning too
        return "no oracle: a validation's loader draws from the random state that dropout draws from"
    return None


def all_cells() -> list[Cell]:
    """The full matrix: every combination of the axes that is a cell."""
    cells = [Cell(*values) for values in itertools.product(SCHEDULES, EVENTS, LAYOUTS, MODELS)]
    return [c for c in cells if excluded(c) is None]


def _values(cell: Cell) -> list[tuple[str, str]]:
    return [
        ("schedule", cell.schedule),
        ("event", cell.event.name),
        ("layout", cell.layout.name),
        ("model", cell.model.name),
    ]


def _pairs(cell: Cell) -> set[tuple]:
    return set(itertools.combinations(_values(cell), 2))


def cost(cell: Cell) -> float:
    """Rough processes x fits of a cell, to keep the sample cheap."""
    if refusal(cell) is not None:
        return 0.2
    fits = 1 + (1 if cell.event.interrupt in ("resume_epoch", "resume_mid", "stop_mid") else 0)
    fits += len(cell.layout.restart_on)
    return cell.layout.devices * fits


def sample(seed: int, cells: Iterable[Cell] | None = None) -> list[Cell]:
    """Cells that run (the traits allow them) and cover every axis value at least once, each chosen
    for the most values and then pairs not yet covered per unit of cost, ties broken by ``seed``;
    then one refused cell per refusal sentence."""
    pool = list(cells if cells is not None else all_cells())
    random.Random(seed).shuffle(pool)
    running = [(c, set(_values(c)), _pairs(c), cost(c)) for c in pool if refusal(c) is None]
    values_left = set().union(*(v for _, v, _, _ in running))
    pairs_seen: set[tuple] = set()
    chosen: list[Cell] = []
    taken: set[int] = set()
    while values_left:
        # the first in the pool's order of the cells with the most values left, then pairs unseen per cost
        best = max(
            (i for i in range(len(running)) if i not in taken),
            key=lambda i, left=values_left, seen=pairs_seen: (
                len(running[i][1] & left),
                len(running[i][2] - seen) / running[i][3],
            ),
        )
        taken.add(best)
        chosen.append(running[best][0])
        values_left -= running[best][1]
        pairs_seen |= running[best][2]
    sentences: set[str] = set()
    for c in pool:
        new = set((refusal(c) or "").split("|")) - {""} - sentences
        if new:
            sentences |= new
            chosen.append(c)
    return chosen


#: layouts the default cover leaves to the full matrix (``--runslow``), with what in the cover runs their case
COVERED_BY_OTHERS = {
    "elastic_shrink": "every elastic_grow cell first restarts on 2 processes (the shrink), then grows back to 4",
}


def cover_pool() -> list[Cell]:
    """The cells the default cover draws from: every cell but those of :data:`COVERED_BY_OTHERS`' layouts."""
    return [c for c in all_cells() if c.layout.name not in COVERED_BY_OTHERS]


def pairs(seed: int, cells: Iterable[Cell] | None = None) -> list[Cell]:
    """Cells that cover every pair of axis values that some running cell of ``cells`` (:func:`cover_pool`'s by
    default) has (greedy: each next cell the one with the most pairs not yet covered per unit of cost, ties
    broken by ``seed``'s order), then one refused cell per refusal sentence: between the sample and the full
    matrix."""
    pool = list(cells if cells is not None else cover_pool())
    random.Random(seed).shuffle(pool)
    running = [(c, _pairs(c), cost(c)) for c in pool if refusal(c) is None]
    left = set().union(*(p for _, p, _ in running))
    # lazy greedy: a cell's gain only falls as pairs get covered, so a stored gain bounds it from above; a
    # cell popped with its gain just computed beats every other (the same choice as recomputing them all)
    heap = [(-len(p) / w, i, -1) for i, (_, p, w) in enumerate(running)]
    heapq.heapify(heap)
    chosen: list[Cell] = []
    while left:
        _, i, when = heapq.heappop(heap)
        if when == len(chosen):
            chosen.append(running[i][0])
            left -= running[i][1]
            continue
        heapq.heappush(heap, (-len(running[i][1] & left) / running[i][2], i, len(chosen)))
    return chosen + [c for c in sample(seed, pool) if refusal(c) is not None]


#: the round-5 defects that fall inside the axes, as cells (always in the default run)
KNOWN: tuple[str, ...] = (
    "xpipe/resume_epoch/p2/sequential",
    "xpipe/validate_mid/p2/sequential",
    "xpipe/save_every_step/p2/sequential",
    "pipemare/validate_mid/p2/sequential",
    "1f1b/fit_predict_test/avgpipe_permuted/sequential",
    "gpipe/resume_epoch/avgpipe_permuted/sequential",
    "1f1b/fit_predict_test/p2/frozen",
    "1f1b/fit_predict_test/elastic_shrink/sequential",
    "1f1b/fit_predict_test/elastic_shrink/zero_token",
)


def by_id(ids: Iterable[str]) -> list[Cell]:
    """The cells named ``schedule/event/layout/model``; an unknown name says what the axes hold."""
    axes = {
        "schedule": {s: s for s in SCHEDULES},
        "event": {e.name: e for e in EVENTS},
        "layout": {layout.name: layout for layout in LAYOUTS},
        "model": {m.name: m for m in MODELS},
    }
    cells = []
    for text in ids:
        parts = text.strip().split("/")
        if len(parts) != 4 or any(p not in axes[a] for p, a in zip(parts, axes)):
            raise ValueError(
                f"cell {text!r}: give schedule/event/layout/model, each one of: "
                + "; ".join(f"{a}: {', '.join(values)}" for a, values in axes.items())
            )
        cells.append(Cell(*(axes[a][p] for p, a in zip(parts, axes))))
    return cells


#: the default run's cover: the same cells for the same code, whatever the date
FIXED_SEED = 0


def references() -> list[Cell]:
    """One cell per asynchronous rule that is held to the rule's one-process reference: the plain model, one
    stage per process, no event that changes the run (``runner._delayed_rule`` writes the rule out for it)."""
    event = next(e for e in EVENTS if e.name == "fit_predict_test")
    layout, model = next(x for x in LAYOUTS if x.name == "p2"), next(m for m in MODELS if m.name == "sequential")
    return [Cell(s, event, layout, model) for s in SCHEDULES if schedule_traits(s, layout.positions).asynchronous]


SEED_VARIABLE, CELL_VARIABLE = "LIGHTNING_PIPE_MATRIX_SEED", "LIGHTNING_PIPE_MATRIX_CELLS"
#: ``sample``: the small cover of every value instead (a quick look; ``--runslow`` runs every cell)
MODE_VARIABLE = "LIGHTNING_PIPE_MATRIX"


def default_seed() -> int:
    """The seed that breaks the cover's ties: ``$LIGHTNING_PIPE_MATRIX_SEED`` (another cover, as complete, for an
    extra look), else :data:`FIXED_SEED`: the default run checks the same cells on any day."""
    given = os.environ.get(SEED_VARIABLE)
    return int(given) if given else FIXED_SEED


def selected(full: bool) -> tuple[int, list[Cell]]:
    """The cells this run checks: ``$LIGHTNING_PIPE_MATRIX_CELLS`` (comma-separated ids) if set, else the full
    matrix (``full``), the small sample (``$LIGHTNING_PIPE_MATRIX=sample``) or, by default, the cover of every
    pair of axis values, each with :data:`KNOWN` and :func:`references` first."""
    seed = default_seed()
    named = os.environ.get(CELL_VARIABLE)
    if named:
        return seed, by_id(named.split(","))
    if full:
        return seed, all_cells()
    first = by_id(KNOWN) + [c for c in references() if c.id not in KNOWN]
    chosen = sample(seed) if os.environ.get(MODE_VARIABLE) == "sample" else pairs(seed)
    return seed, first + [c for c in chosen if c not in first]
