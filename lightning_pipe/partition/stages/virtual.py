"""Several stages per process: which process holds which stage, and the modules that hold them.

The layers are split into ``p x v`` stages by ``balance``; each process holds ``v`` of them (where
depends on the schedule: every ``p``-th stage for interleaved 1F1B, a V for ZB-V). Chimera splits
the layers into ``p`` stages and runs each twice: schedule stage ``s`` of its ``2p`` runs the layers
of split stage ``s mod p`` (:func:`split_of`), the copy ``p + k`` on process ``p - 1 - k``. The process's
LightningModule gets one module with all its layers under their original names (so parameter
names, checkpoints and optimizers see one module), and each stage runs as its own view of it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from torch import nn

from lightning_pipe.partition.solvers.balance import stage_bounds
from lightning_pipe.partition.stages.split import Layers, stage_layers
from lightning_pipe.runtime.around.held_layers import held_layers
from lightning_pipe.runtime.blocks.container import BlockShell, BlockStage
from lightning_pipe.runtime.crossing.skips import recorded_names, skip_routes, skips_from, skips_into
from lightning_pipe.runtime.stage import StageModule

Stage = StageModule | BlockStage


def split_of(stage: int, num_split: int) -> int:
    """The split stage (of ``num_split``) whose layers schedule stage ``stage`` runs: itself, or for
    Chimera's copies (stages ``num_split`` and up), the stage they copy."""
    return stage % num_split


def split_stages(
    layers: Layers, balance: Sequence[int], positions: Sequence[int], position: int, path: str = ""
) -> tuple[Stage, dict[int, Stage]]:
    """The module that replaces the layers on pipeline ``position`` and its stages by index. With
    one stage per position the two are the same module. An ``nn.Sequential`` becomes
    :class:`StageModule` (the model calls it); an ``nn.ModuleList`` of blocks becomes
    :class:`BlockStage` (the model's forward loops over it). With more schedule stages than the
    split has (Chimera's two copies), stage ``s`` runs split stage ``s mod len(balance)``, as the
    first or last stage where that one is. ``path``: the Sequential's name in the model, for messages.
    The Sequential's stage modules keep its positions (:mod:`lightning_pipe.runtime.around.held_layers`)."""
    num_stages, num_split = len(positions), len(balance)
    make: Callable[[OrderedDict[str, nn.Module], int, int], Stage]
    if isinstance(layers, nn.Sequential):
        # every position of the unsplit Sequential, with its stand-in where another stage holds it
        everywhere = list(
            zip((key for key, _ in layers.named_children()), held_layers(layers, stage_bounds(balance), path))
        )
        make = lambda held, s, n: StageModule(held, s, n, everywhere)  # noqa: E731
    else:
        shells = [BlockShell(block) for block in layers]
        stand_ins = held_layers(layers, stage_bounds(balance), path)
        make = lambda held, s, n: BlockStage(held, s, n, shells, stand_ins)  # noqa: E731
    mine = [s for s, p in enumerate(positions) if p == position]
    if num_stages == num_split:
        stages = {s: make(stage_layers(layers, balance, s), s, num_stages) for s in mine}
    else:
        stages = {
            s: make(stage_layers(layers, balance, split_of(s, num_split)), split_of(s, num_split), num_split)
            for s in mine
        }
    if isinstance(layers, nn.Sequential):
        routes = skip_routes(list(layers), balance)  # skip connections: which stage sends which to which
        for s, module in stages.items():
            assert isinstance(module, StageModule)
            module.skip_sources = skips_into(routes, split_of(s, num_split))
            module.skip_targets = skips_from(routes, split_of(s, num_split))
            module.records = tuple(n for layer in layers for n in recorded_names(layer))
    for module in stages.values():
        module.path = path
    if len(stages) == 1:
        return stages[mine[0]], stages
    held: OrderedDict[str, nn.Module] = OrderedDict()
    for s in sorted(mine, key=lambda s: split_of(s, num_split)):  # the layers in their order, whatever their names
        held.update(stage_layers(layers, balance, split_of(s, num_split)))
    host = make(held, min(mine), num_stages)
    host.path = path
    host.held = (tuple(sorted({split_of(s, num_split) for s in mine})), num_split)  # what errors name
    return host, stages


def ties_by_position(
    ties: Sequence[dict[int, str]], positions: Sequence[int], num_split: int | None = None
) -> list[dict[int, str]]:
    """Weights shared across stages, keyed by the positions that hold a copy (two stages on one
    position share the very tensor and need no reduction); only ties over several positions. Ties
    are given over the ``num_split`` stages of the split (default: one per entry of ``positions``);
    where the schedule runs copies of them (Chimera), a position holding several of the tied layers
    names the tensor as its module does (the lowest layer's name)."""
    num_split = len(positions) if num_split is None else num_split
    out = []
    for tie in ties:
        held: dict[int, str] = {}
        stages = [s for s in range(len(positions)) if split_of(s, num_split) in tie]
        for stage in sorted(stages, key=lambda s: (split_of(s, num_split), s)):
            held.setdefault(positions[stage], tie[split_of(stage, num_split)])
        if len(held) > 1:
            out.append(held)
    return out
