"""How a LightningModule becomes this rank's pipeline: its ``nn.Sequential`` split into stages
(:func:`split_module`), then a :class:`~lightning_pipe.runtime.pipeline.StagePipeline` over them
(:func:`build_pipeline`).

The split runs in the strategy's setup, before the optimizers exist: ``plan="auto"`` and the
measured balances profile the layers first (every rank at once; rank 0's numbers decide), then
each rank keeps only its stages (built on the meta device, only they get storage), loads them
from ``weights=`` if given, and puts them in the module under the Sequential's own attribute and
layer names. What it decided is kept in a :class:`ModuleSplit` for the run, so a second setup
(test after fit) finds the module split and reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_pipe.checkpoint import tie_aliases
from lightning_pipe.compatibility import as_misconfiguration, check_async, check_chimera_layout, check_shard
from lightning_pipe.config import PipelineConfig
from lightning_pipe.partition import find_sequential, resolve_balance, tied_parameters
from lightning_pipe.partition.costs import MEASURED_BALANCES, Profile
from lightning_pipe.partition.materialize import has_meta_tensors, materialize
from lightning_pipe.partition.measured import MeasureInputs, measured_balance
from lightning_pipe.partition.profile import first_batch
from lightning_pipe.partition.split import stage_bounds
from lightning_pipe.partition.virtual import split_of, split_stages, stage_positions, ties_by_position
from lightning_pipe.plan.auto import apply_plan
from lightning_pipe.run_report import describe_layout
from lightning_pipe.runtime.copies import renamed_ties, written_elsewhere
from lightning_pipe.runtime.pipeline import StagePipeline, StageSplit
from lightning_pipe.runtime.stage import StageModule
from lightning_pipe.runtime.topology import Placement, Topology
from lightning_pipe.schedules import is_async
from lightning_pipe.weights import load_stage_weights, model_spec


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
    """

    config: PipelineConfig
    placement: Placement
    attribute: str
    split: StageSplit
    balance: Optional[list[int]] = None
    deferred_build: bool = False
    profile: Optional[Profile] = None
    candidates: Optional[list[Any]] = None

    def optimizer_aliases(self) -> dict[str, str]:
        """This rank's names of weights tied to an earlier stage's layer -> the unsplit module's name
        for them, so that a consolidated optimizer state holds such a tensor once, as plain training does."""
        return tie_aliases(self.split.ties, self.placement.stage, f"{self.attribute}.")

    def written_elsewhere(self) -> dict[str, Any]:
        """What this rank leaves to another rank when writing a checkpoint (Chimera's second copies:
        each stage is written once, by its down pipeline's process), as ``stage_io.Writer``'s ``skip``
        (state-dict names) and ``rename`` (a tied weight's optimizer state kept under this rank's name)."""
        num_split = len(self.balance) if self.balance else len(self.split.stages)
        skip = written_elsewhere(self.split.stages, num_split, f"{self.attribute}.")
        return {"skip": skip, "rename": renamed_ties(self.split.host, skip, f"{self.attribute}.") if skip else {}}


def split_module(
    module: Any,
    config: PipelineConfig,
    topology: Topology,
    device: torch.device,
    to_device: Callable[[Any, torch.device], Any],
    broadcast: Callable[[Any], Any],
    context: Callable[[], ContextManager[Any]],
    previous: Optional[ModuleSplit] = None,
) -> ModuleSplit:
    """Replace the Sequential by this rank's stage, under the same attribute and layer names.

    Measuring (``plan="auto"``, ``balance="time"/"memory"``) moves the run's first batch with
    ``to_device``, runs in the precision's ``context`` on ``device`` and gives every rank rank 0's
    numbers with ``broadcast``. ``previous``: what an earlier setup of the run decided."""
    layout, rank, backend = topology.layout, topology.rank, topology.backend
    inputs = measure_inputs(module, to_device, device, rank == 0, broadcast, context)
    name, layers = find_sequential(module, config.module)
    if isinstance(layers, StageModule):  # set up before (fit, then test): already split
        if previous is not None:
            return previous
        placement = Placement(layout, rank, tuple(range(layout.stages)), device, backend)
        return ModuleSplit(config, placement, name, StageSplit(layers, {placement.stage: layers}))
    profile = previous.profile if previous is not None else None
    candidates = previous.candidates if previous is not None else None
    if config.plan == "auto" and layout.stages > 1 and candidates is None:
        config, profile, candidates = apply_plan(config, layout, module, layers, inputs)
    virtual = config.virtual_stages
    assert virtual is not None
    positions = stage_positions(config.schedule, layout.stages, virtual)
    num_split = layout.stages * virtual  # Chimera's 2 x stages run copies of these
    check_chimera_layout(config.schedule, layout.stages, layout.replicas)
    placement = Placement(layout, rank, tuple(positions), device, backend)
    if config.balance in MEASURED_BALANCES and num_split > 1:
        p = layout.stages
        balance, profile = measured_balance(
            config.schedule, str(config.balance), config.checkpoint, p, config.num_microbatches(p), virtual,
            module, layers, inputs, profile,
        )  # fmt: skip
    elif config.balance in MEASURED_BALANCES:
        balance = [len(layers)]
    else:
        balance = resolve_balance(config.balance, layers, num_split)
    ties = ties_by_position(tied_parameters(layers, balance), positions, num_split)
    spec = model_spec(module) if config.weights is not None else None
    stage, stages = split_stages(layers, balance, positions, placement.stage)
    deferred_build = has_meta_tensors(module)
    if deferred_build:
        bounds = stage_bounds(balance)
        local = [i for s in sorted({split_of(s, num_split) for s in stages}) for i in range(*bounds[s])]
        materialize(module, layers, local, device)
    setattr(module, name, stage)
    if spec is not None:
        load_stage_weights(module, config.weights, spec, report=rank_zero_info)
    if rank == 0:  # where Lightning prints its own setup lines, in any script
        chunks = config.num_microbatches(layout.stages)
        rank_zero_info(describe_layout(module.trainer, layout.stages, layout.replicas, balance, positions, config.schedule, chunks))
    return ModuleSplit(config, placement, name, StageSplit(stage, stages, ties), balance, deferred_build, profile, candidates)


def measure_inputs(
    module: Any,
    to_device: Callable[[Any, torch.device], Any],
    device: torch.device,
    is_source: bool,
    broadcast: Callable[[Any], Any],
    context: Callable[[], ContextManager[Any]],
) -> MeasureInputs:
    """What profiling before the split needs: the run's first batch (drawn when first asked for,
    moved by ``to_device`` to the device the module's tensors are on), this rank's device, whether
    its numbers decide, the broadcast and the precision's training context."""

    def batch() -> Any:
        home = next((t.device for t in module.state_dict().values()), torch.device("cpu"))
        return to_device(first_batch(module.trainer), home)

    return MeasureInputs(batch, device, is_source, broadcast, context)


def build_pipeline(module: nn.Module, split: ModuleSplit, topology: Topology, scaler: Any) -> StagePipeline:
    """This rank's pipeline over the split stages, after refusing the combinations of schedule,
    sharding, ties, parameters outside the Sequential and precision that cannot train."""
    config, placement = split.config, split.placement
    prefix = f"{split.attribute}."
    shared = [p for n, p in sorted(module.named_parameters()) if not n.startswith(prefix)]
    tied = bool(split.split.ties)
    if config.data_parallel == "shard" and placement.num_replicas > 1:
        check_shard(config.schedule, shared, tied)
    if is_async(config.schedule):
        p = placement.num_stages
        check_async(config.schedule, module, shared, tied, p, config.num_microbatches(p), scaler)
    with as_misconfiguration():
        return StagePipeline(config, placement, split.split, topology, module, shared)


__all__ = ["ModuleSplit", "build_pipeline", "measure_inputs", "split_module"]
