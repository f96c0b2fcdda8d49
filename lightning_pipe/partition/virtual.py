"""Several stages per process: which process holds which stage, and the modules that hold them.

The layers are split into ``p x v`` stages by ``balance``; each process holds ``v`` of them (where
depends on the schedule: every ``p``-th stage for interleaved 1F1B, a V for ZB-V). The process's
LightningModule gets one module with all its layers under their original names (so parameter
names, checkpoints and optimizers see one module), and each stage runs as its own view of it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence, Union

from torch import nn

from lightning_pipe.partition.split import Layers, stage_layers
from lightning_pipe.runtime.blocks import BlockShell, BlockStage
from lightning_pipe.runtime.stage import StageModule
from lightning_pipe.schedules.zero_bubble import zbv_stage_to_rank


def stage_positions(schedule: str, num_ranks: int, virtual_stages: int) -> list[int]:
    """For each of the ``num_ranks x virtual_stages`` stages, the pipeline position that holds it."""
    if schedule == "zbv":
        return zbv_stage_to_rank(num_ranks)
    return [s % num_ranks for s in range(num_ranks * virtual_stages)]


Stage = Union[StageModule, BlockStage]


def split_stages(
    layers: Layers, balance: Sequence[int], positions: Sequence[int], position: int
) -> tuple[Stage, dict[int, Stage]]:
    """The module that replaces the layers on pipeline ``position`` and its stages by index. With
    one stage per position the two are the same module. An ``nn.Sequential`` becomes
    :class:`StageModule` (the model calls it); an ``nn.ModuleList`` of blocks becomes
    :class:`BlockStage` (the model's forward loops over it)."""
    num_stages = len(positions)
    make: Callable[["OrderedDict[str, nn.Module]", int], Stage]
    if isinstance(layers, nn.Sequential):
        make = lambda held, s: StageModule(held, s, num_stages)  # noqa: E731
    else:
        shells = [BlockShell(block) for block in layers]
        make = lambda held, s: BlockStage(held, s, num_stages, shells)  # noqa: E731
    mine = [s for s, p in enumerate(positions) if p == position]
    stages = {s: make(stage_layers(layers, balance, s), s) for s in mine}
    if len(stages) == 1:
        return stages[mine[0]], stages
    held: "OrderedDict[str, nn.Module]" = OrderedDict()
    for s in sorted(mine):
        held.update(stage_layers(layers, balance, s))
    host = make(OrderedDict(sorted(held.items(), key=lambda kv: int(kv[0]))), min(mine))
    return host, stages


def ties_by_position(ties: Sequence[dict[int, str]], positions: Sequence[int]) -> list[dict[int, str]]:
    """Weights shared across stages, keyed by the positions that hold a copy (two stages on one
    position share the very tensor and need no reduction); only ties over several positions."""
    out = []
    for tie in ties:
        held: dict[int, str] = {}
        for stage, name in sorted(tie.items()):
            held.setdefault(positions[stage], name)
        if len(held) > 1:
            out.append(held)
    return out
