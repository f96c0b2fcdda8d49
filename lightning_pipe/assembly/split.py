"""How a module becomes this rank's pipeline: its ``nn.Sequential`` split into stages
(:func:`split_module`), then a :class:`~lightning_pipe.runtime.pipeline.StagePipeline` over them
(:func:`pipeline_for`), which runs by the options resolved from the run's arguments
(:func:`pipeline_options`). Nothing here knows the Trainer: the strategy's setup
(:mod:`lightning_pipe.trainer.stage_setup`) and a plain PyTorch loop (:mod:`lightning_pipe.assembly.build`)
both call it, each handing in how it reports and measures.

The split runs before the optimizers exist: ``plan="auto"`` and the
measured balances profile the layers first (every rank at once; rank 0's numbers decide), then
each rank keeps only its stages (built on the meta device, only they get storage), loads them
from ``weights=`` if given, and puts them in the module under the Sequential's own attribute and
layer names. What it decided is kept in a :class:`ModuleSplit` for the run, so a second setup
(test after fit) finds the module split and reuses it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_pipe.assembly.refusals import check_async, check_chimera_layout, check_elastic_scaler, check_shard
from lightning_pipe.checkpoint import stage_io, tie_aliases
from lightning_pipe.config import PipelineConfig
from lightning_pipe.partition import (
    check_stage_parameters,
    find_sequential,
    foreign_parameters,
    layer_owners,
    place,
    release_elsewhere,
    release_parameters,
    resolve_balance,
    tied_parameters,
)
from lightning_pipe.partition.measure.measured import (
    BalanceTarget,
    MeasureInputs,
    RankResources,
    agreed_resources,
    measured_balance,
)
from lightning_pipe.partition.solvers.costs import MEASURED_BALANCES, Profile
from lightning_pipe.partition.stages.end_trace import TracedEnds
from lightning_pipe.partition.stages.ends import (
    end_parameters,
    end_stages,
    ends_line,
    extended,
    held_end_parameters,
    local_end_indices,
    model_ends,
    stand_in_ends,
)
from lightning_pipe.partition.stages.materialize import has_meta_tensors, materialize
from lightning_pipe.partition.stages.split import stage_bounds
from lightning_pipe.partition.stages.virtual import split_of, split_stages, ties_by_position
from lightning_pipe.plan.auto import apply_plan
from lightning_pipe.resolve import resolve
from lightning_pipe.runtime.activations.policy import uniform_recompute
from lightning_pipe.runtime.blocks.container import BlockStage
from lightning_pipe.runtime.crossing.skips import skip_routes
from lightning_pipe.runtime.grads.copies import renamed_ties, written_elsewhere
from lightning_pipe.runtime.options import PipelineOptions
from lightning_pipe.runtime.pipeline import StagePipeline, StageSplit
from lightning_pipe.runtime.stage import StageModule
from lightning_pipe.runtime.topology import Layout, Placement, Topology
from lightning_pipe.schedules import is_async, stage_positions, traits
from lightning_pipe.weights import load_stage_weights, model_spec

log = logging.getLogger(__name__)

#: Tells a line to the user (the Trainer's rank-zero log, or the logging module's).
Report = Callable[[str], None]
#: Traces one step of a model of the user's own to find its ends (see :mod:`lightning_pipe.partition.stages.end_trace`).
TraceEnds = Callable[[Any, nn.Sequential | nn.ModuleList, PipelineConfig, int, MeasureInputs], TracedEnds | None]


@dataclass
class ModuleSplit:
    """What splitting the user's module decided, for the rest of the run.

    Attributes:
        config: the arguments as run (with ``plan="auto"``, the planner's choice).
        placement: where this rank's stages sit.
        attribute: the split Sequential's attribute in the module.
        split: the stage modules this rank holds.
        balance: layers per stage (None where the module came already split).
        deferred_build: whether the module was built on the meta device.
        profile: the measured layer costs (``balance="time"/"memory"``, ``plan="auto"``).
        candidates: ``plan="auto"``: the ranked layouts; the first one runs.
        held_ends: the parameters of a model's ends (its embeddings, see
            :mod:`lightning_pipe.partition.stages.ends`) that this rank's stages hold.
        resources: every rank's speed and free memory that weighted the measured split
            (``balance="time"/"memory"``; None where none was measured).
        names: the unsplit module's state-dict names in its own order, which a consolidated checkpoint
            keeps (the stages' files hold them by process, and a process can hold the first and last stage).
    """

    config: PipelineConfig
    placement: Placement
    attribute: str
    split: StageSplit
    balance: list[int] | None = None
    deferred_build: bool = False
    profile: Profile | None = None
    candidates: list[Any] | None = None
    held_ends: list[nn.Parameter] = field(default_factory=list)
    resources: RankResources | None = None
    names: tuple[str, ...] = ()

    def optimizer_aliases(self) -> dict[str, str]:
        """This rank's names of weights tied to an earlier stage's layer -> the unsplit module's name
        for them, so that a consolidated optimizer state holds such a tensor once, as plain training does."""
        return tie_aliases(self.split.ties, self.placement.stage, "")

    def random_key(self) -> list[Any]:
        """What a resume must share with the saved run for each rank's saved random state to be its own."""
        return layout_key(self.placement.layout, self.balance)

    def writer(
        self, topology: Topology, is_global_zero: bool, broadcast: Callable[[Any], Any], barrier: Callable[[], None]
    ) -> stage_io.Writer:
        """Where this rank stands when it writes a checkpoint: its stage and replica, the replicas'
        group where they hold shards, and what it leaves to another rank (Chimera's second copies:
        each stage is written once, by its down pipeline's process) as ``skip`` (state-dict names)
        and ``rename`` (a tied weight's optimizer state kept under this rank's name)."""
        placement, prefix = self.placement, f"{self.attribute}."
        sharded = self.config.data_parallel == "shard" and placement.num_replicas > 1
        num_split = len(self.balance) if self.balance else len(self.split.stages)
        skip = written_elsewhere(self.split.stages, num_split, prefix)
        rename = renamed_ties(self.split.host, skip, prefix) if skip else {}
        return stage_io.Writer(
            placement.stage, placement.num_stages, placement.replica, is_global_zero, broadcast, barrier,
            topology.dp_group if sharded else None, skip, rename, self.random_key(), self.names,
        )  # fmt: skip


@dataclass(frozen=True)
class SplitCalls:
    """What :func:`split_module` asks of its caller beyond the module and the arguments.

    Attributes:
        report: tells a line on rank 0 (the planner's choice, the ends found, the weights loaded).
        trace: finds the ends of a model of the user's own by tracing a step; None: the arguments name them.
        describe: tells the layout that runs, on rank 0: ``(config, layout, decision, placement, candidates,
            skips)``; None: told by nobody.
    """

    report: Report = log.info
    trace: TraceEnds | None = None
    describe: Callable[..., None] | None = None


def layout_key(layout: Layout, balance: Sequence[int] | None) -> list[Any]:
    """What must match for a rank's saved state to be its own: every rank's stage and replica, and
    the layers per stage."""
    ranks = [[layout.stage_of(r), layout.replica_of(r)] for r in range(layout.world_size)]
    return [ranks, list(balance) if balance else None]


def split_module(
    module: Any,
    config: PipelineConfig,
    layout: Layout,
    rank: int,
    inputs: MeasureInputs,
    calls: SplitCalls = SplitCalls(),
    previous: ModuleSplit | None = None,
) -> ModuleSplit:
    """Replace the Sequential by this rank's stage, under the same attribute and layer names.

    Its steps: the plan (``plan="auto"``), the split's decision (:func:`decide_split`, which the
    launching process also runs as a dry run before the launch), then this rank's stages built and put
    in place (:func:`_keep_stages`). Measuring (``plan="auto"``, ``balance="time"/"memory"``) takes the
    run's first batch, device, precision context and broadcast from ``inputs``. ``previous``: what an
    earlier setup of the run decided.
    ``layout``: the world's stages x replicas, which a measured split or the planner may place anew (on
    unequal devices, which rank holds which stage); the split's placement holds the layout that runs."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    device = inputs.device
    name, layers = find_sequential(module, config.module)
    if isinstance(layers, (StageModule, BlockStage)):  # set up before (fit, then test): already split
        if previous is not None:
            return previous
        placement = Placement(layout, rank, tuple(range(layout.stages)), device, backend)
        return ModuleSplit(config, placement, name, StageSplit(layers, {placement.stage: layers}))
    profile = previous.profile if previous is not None else None
    candidates = previous.candidates if previous is not None else None
    if config.plan == "auto" and layout.stages > 1 and candidates is None:
        config, profile, candidates = apply_plan(config, layout, module, layers, inputs, calls.report)
        layout = layout.placed(config.rank_order)
    resources = previous.resources if previous is not None else None  # measured once a run, as the profile
    measured = _Measurement(module, layers, config, layout, inputs, profile, resources)
    traced = calls.trace(module, layers, config, layout.stages, inputs) if calls.trace is not None else None
    decision = decide_split(module, layers, config, layout, measured.balance, traced)
    if rank == 0 and traced is not None and (line := ends_line(traced, decision.ends)):
        calls.report(line)
    assert decision.balance is not None  # with a measurement, every balance is known
    placement = Placement(measured.layout, rank, tuple(decision.positions), device, backend)
    names = tuple(module.state_dict(keep_vars=True))  # before the split: the whole module's order
    split, held_split, deferred_build = _keep_stages(module, name, layers, config, decision, placement, calls.report)
    if rank == 0 and not config.plan_all_layouts and calls.describe is not None:  # `plan` trains nothing
        skips = skip_routes(list(layers), decision.balance) if isinstance(layers, nn.Sequential) else {}
        calls.describe(config, measured.layout, decision, placement, candidates, skips)
    held_ends = held_end_parameters(decision.ends, held_split, decision.num_split)
    return ModuleSplit(
        config,
        placement,
        name,
        split,
        decision.balance,
        deferred_build,
        measured.profile,
        candidates,
        held_ends,
        measured.resources,
        names,
    )


@dataclass(frozen=True)
class SplitDecision:
    """What splitting a module's layers into a layout decides before anything is built or moved.

    Attributes:
        positions: the process (pipeline position) of each split stage.
        num_split: the split's stages (processes x virtual stages; Chimera runs copies of them).
        ends: the model's ends (its embeddings, see :mod:`lightning_pipe.partition.stages.ends`), held by
            the end stages.
        owners: which layers hold a parameter.
        balance: layers per split stage; None where a measured balance decides it in the setup.
        tied: the weights tied across split stages (stage -> name in the layers); None where the
            balance is not known yet.
    """

    positions: list[int]
    num_split: int
    ends: Any
    owners: list[bool]
    balance: list[int] | None
    tied: list[dict[int, str]] | None


def decide_split(
    module: nn.Module,
    layers: nn.Sequential | nn.ModuleList,
    config: PipelineConfig,
    layout: Layout,
    measure: Callable[[int, list[bool]], list[int]] | None = None,
    traced: TracedEnds | None = None,
) -> SplitDecision:
    """What :func:`split_module` decides and refuses for ``layers`` of ``module``, without building or
    moving anything: the schedule's layout (a block container's limits, Chimera's), the balance, a
    process left without parameters, the ties. ``measure``: ``(split stages, owners) -> layers per stage``
    for a measured balance (``balance="time"/"memory"``, the setup's). Without it, a dry run (the
    launching process's preflight): a measured balance is left to the setup, which refuses more stages
    than layers as the dry run does here. ``traced``: the ends one traced step found (a model of the user's own),
    where the arguments do not name them."""
    if not isinstance(layers, nn.Sequential):
        refuse_for_blocks(config)
    virtual = config.virtual_stages or 1  # PipelineConfig resolves it
    positions = stage_positions(config.schedule, layout.stages, virtual)
    num_split = layout.stages * virtual  # Chimera's 2 x stages run copies of these
    check_chimera_layout(config.schedule, layout.stages, layout.replicas)
    ends = model_ends(module, layers, config.first_stage, config.last_stage, traced)  # held by the end stages only
    owners = layer_owners(layers, end_parameters(ends))
    balance = _balance(layers, config, num_split, ends, owners, measure)
    if balance is None:
        return SplitDecision(positions, num_split, ends, owners, None, None)
    check_held_parameters(module, layers, ends, balance, positions, num_split, owners)
    tied = tied_parameters(extended(layers, ends), balance, end_stages(len(layers), ends, num_split))
    return SplitDecision(positions, num_split, ends, owners, balance, tied)


def _balance(
    layers: nn.Sequential | nn.ModuleList,
    config: PipelineConfig,
    num_split: int,
    ends: Any,
    owners: list[bool],
    measure: Callable[[int, list[bool]], list[int]] | None,
) -> list[int] | None:
    """Layers per split stage: the given balance resolved, or measured with ``measure`` (one stage
    holds every layer); None for a measured balance without ``measure``, after refusing more stages
    than layers as the measured split would."""
    if config.balance not in MEASURED_BALANCES:
        return resolve_balance(config.balance, layers, num_split, end_parameters(ends))
    if measure is None:
        if len(layers) < num_split:
            resolve_balance("uniform", layers, num_split, end_parameters(ends))  # raises: more stages than layers
        return None
    if num_split == 1:
        return [len(layers)]
    return measure(num_split, owners)


@dataclass
class _Measurement:
    """The measured balance's step of :func:`split_module` (``balance="time"/"memory"``): every rank's
    speed or free memory, the profile and the rank order they place (the layout that runs), kept for
    the run; ``profile`` and ``resources``: an earlier setup's (or the planner's profile)."""

    module: Any
    layers: nn.Sequential | nn.ModuleList
    config: PipelineConfig
    layout: Layout
    inputs: MeasureInputs
    profile: Profile | None
    resources: RankResources | None

    def balance(self, num_split: int, owners: list[bool]) -> list[int]:
        """Layers per stage of ``num_split``, measured; places the ranks (:attr:`layout`)."""
        config, layout, p = self.config, self.layout, self.layout.stages
        timed = config.balance == "time"  # every rank's speed (time) or free memory
        if self.resources is None:
            self.resources = agreed_resources(
                self.inputs.gather, self.inputs.device, config.rank_speeds, layout.world_size, timed, not timed
            )
        fixed = layout.order if config.rank_order is not None else None  # else placed by the ranks' speeds
        virtual = config.virtual_stages or 1  # PipelineConfig resolves it
        recompute = uniform_recompute(config.recompute) or "never"  # one mode here (config.check_stage_recompute)
        target = BalanceTarget(
            str(config.balance), config.schedule, recompute, p, config.num_microbatches(p), virtual,
            layout.replicas, fixed,
        )  # fmt: skip
        balance, self.profile, order = measured_balance(
            target, self.module, self.layers, self.inputs, self.profile, owners, self.resources
        )
        self.layout = layout.placed(order)
        return balance


def _keep_stages(
    module: Any,
    name: str,
    layers: nn.Sequential | nn.ModuleList,
    config: PipelineConfig,
    decision: SplitDecision,
    placement: Placement,
    report: Report,
) -> tuple[StageSplit, list[int], bool]:
    """Keep this rank's stages of ``decision`` in ``module``: materialised where the module was built on
    the meta device, under the Sequential's attribute, the rest released, ``weights=`` loaded. Returns
    the stages, the split stages held (Chimera: copies of them) and whether the module was built on the
    meta device."""
    balance, positions, num_split, ends = decision.balance, decision.positions, decision.num_split, decision.ends
    assert balance is not None and decision.tied is not None
    with_ends = extended(layers, ends)
    paths = [f"{name}.{key}" for key, _ in layers.named_children()] + [path for path, _ in ends.pre + ends.post]
    ties = ties_by_position([in_module(tie, paths) for tie in decision.tied], positions, num_split)
    spec = model_spec(module) if config.weights is not None else None
    stage, stages = split_stages(layers, balance, positions, placement.stage, name)
    deferred_build = has_meta_tensors(module)
    bounds = stage_bounds(balance)
    held_split = sorted({split_of(s, num_split) for s in stages})  # Chimera: copies of the split's stages
    local = [i for s in held_split for i in range(*bounds[s])]
    local += local_end_indices(len(layers), ends, held_split, num_split)
    foreign = foreign_parameters(module, with_ends, local)  # by identity, before materialising makes new tensors
    if deferred_build:
        materialize(module, with_ends, local, placement.device, init=config.init)
    place(module, name, stage)
    stand_in_ends(module, ends, first=0 in held_split)
    release_elsewhere(module, with_ends, local, stage)
    release_parameters(foreign)
    if spec is not None and config.weights is not None:
        load_stage_weights(module, config.weights, spec, rename=config.rename, report=report)
    return StageSplit(stage, stages, ties), held_split, deferred_build


def check_held_parameters(
    module: nn.Module,
    layers: nn.Sequential | nn.ModuleList,
    ends: Any,
    balance: list[int],
    positions: list[int],
    num_split: int,
    owners: list[bool],
) -> None:
    """Refuse a split that leaves a process without any parameter (its optimizer would get an empty
    parameter list), unless the module holds parameters outside the split, which every process keeps."""
    if parameters_beyond(module, layers, ends):
        return
    processes = [
        sorted({split_of(s, num_split) for s, q in enumerate(positions) if q == p}) for p in range(max(positions) + 1)
    ]
    check_stage_parameters(balance, layers, processes, owners)


def parameters_beyond(module: nn.Module, layers: nn.Module, ends: Any) -> bool:
    """Whether ``module`` holds a parameter outside the split layers and the end stages' modules:
    one that every process keeps, so that no process's optimizer is left without parameters."""
    split = {id(p) for p in layers.parameters()}
    split |= {id(p) for _, end in ends.pre + ends.post for p in end.parameters()}
    return any(id(p) not in split for p in module.parameters())


def in_module(tie: dict[int, str], paths: list[str]) -> dict[int, str]:
    """A tie's names (``"<layer index>.<name in the layer>"``) as names in the user's module."""
    out = {}
    for stage, name in tie.items():
        index, _, rest = name.partition(".")
        out[stage] = f"{paths[int(index)]}.{rest}"
    return out


def refuse_for_blocks(config: PipelineConfig) -> None:
    """What a block container (an ``nn.ModuleList`` the model's forward loops over) cannot run yet."""
    if not traits(config.schedule).block_containers:
        raise ValueError(
            f"PipelineStrategy(module={config.module!r}) names a block container, and schedule={config.schedule!r} "
            "runs copies of the split's stages, which block containers do not yet have. Use another schedule (such as "
            "'zero_bubble' or 'interleaved_1f1b'), or an nn.Sequential."
        )


def gather_objects() -> Callable[[Any], list[Any]] | None:
    """Every global rank's object, on every rank (an all-gather over the world), or None in a world
    of one process."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None

    def gather(value: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out

    return gather


def pipeline_options(config: PipelineConfig, placement: Placement) -> PipelineOptions:
    """What the pipeline runs by: the run's arguments resolved once for this rank's layout
    (:func:`~lightning_pipe.resolve.resolve`)."""
    return resolve(config, placement.layout)


def pipeline_for(module: nn.Module, split: ModuleSplit, topology: Topology, scaler: Any = None) -> StagePipeline:
    """This rank's pipeline over the split stages, after refusing the combinations of schedule,
    sharding, ties, parameters outside the Sequential and precision that cannot train
    (:class:`~lightning_pipe.assembly.refusals.LayoutRefused`). ``scaler``: a gradient scaler, if any."""
    config, placement = split.config, split.placement
    held = {id(p) for p in split.split.host.parameters()} | {id(p) for p in split.held_ends}
    # by identity: a parameter also reachable under another name (a tie, a model kept beside its
    # Sequential) is the stage's own, not one outside the split layers
    shared = [p for n, p in sorted(module.named_parameters()) if id(p) not in held]
    tied = bool(split.split.ties)
    beyond_layers = shared + split.held_ends  # outside the split layers: versioned and sharded with their stage
    blocks = split.attribute if isinstance(split.split.host, BlockStage) else None  # the messages name the container
    if config.data_parallel == "shard" and placement.num_replicas > 1:
        check_shard(config.schedule, beyond_layers, tied, blocks)
    check_elastic_scaler(config.replicas_sync, scaler)
    if is_async(config.schedule):
        p = placement.num_stages
        check_async(config.schedule, module, beyond_layers, tied, p, config.num_microbatches(p), scaler, blocks)
    return StagePipeline(pipeline_options(config, placement), placement, split.split, topology, module, shared)
