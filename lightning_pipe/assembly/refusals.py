"""The combinations of schedule, layout, sharding, tied weights, parameters outside the split and
precision that cannot train, refused before the first batch with the reason and what to change.

Each refusal is a :class:`LayoutRefused` (a ``ValueError``); the Trainer's side turns it into
Lightning's configuration error, a plain PyTorch loop sees it as it is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_pipe.schedules import is_async, traits
from lightning_pipe.schedules.families.asynchronous import min_chunks


class LayoutRefused(ValueError):
    """A run's arguments that cannot train together on this layout; the message says what to change."""


def split_layers(blocks: str | None) -> str:
    """What the split layers are, for a message: ``blocks`` is the ``module=`` path of a block
    container (an ``nn.ModuleList`` the model's forward loops over), None for an ``nn.Sequential``."""
    return "the split nn.Sequential" if blocks is None else f"the blocks of the block container {blocks!r}"


def check_shard(schedule: str, shared: Sequence[nn.Parameter], tied: bool, blocks: str | None = None) -> None:
    """``data_parallel='shard'`` (FSDP2) keeps one weight version. Parameters outside the split layers
    (``shared``; ``blocks``: the ``module=`` path when the split layers are a block container) and
    weights tied across stages are sharded with their stage (:mod:`lightning_pipe.runtime.replicas.sharding`),
    unless the schedule puts both ends of a tie on one process (a V)."""
    if is_async(schedule):
        raise LayoutRefused(
            f"PipelineStrategy(data_parallel='shard') cannot run here: schedule={schedule!r} keeps weight versions, "
            "which sharded weights do not have. Use data_parallel='replicate' (or a synchronous schedule)."
        )
    if tied and traits(schedule).placement == "v":
        raise LayoutRefused(
            f"PipelineStrategy(data_parallel='shard') cannot run here: weights are tied across stages, and "
            f"schedule={schedule!r} places the first and last stage on one process, where FSDP2 would shard the tied "
            "weight in two units. Use data_parallel='replicate', or a schedule that places them on different processes "
            "('1f1b', 'zero_bubble', 'interleaved_1f1b')."
        )


def check_elastic_scaler(replicas_sync: str, scaler: Any) -> None:
    """Elastic averaging counts optimizer steps on every replica alike; a gradient scaler skips a step
    where this replica's own gradients overflowed, which the other replicas' need not."""
    if replicas_sync == "elastic" and scaler is not None:
        raise LayoutRefused(
            "PipelineStrategy(replicas_sync='elastic') with a gradient scaler (precision='16-mixed'): each replica "
            "steps on its own gradients, so one may skip a step that the others take, and their averagings would no "
            "longer match. Use precision='bf16-mixed' or '32-true', or replicas_sync='allreduce'."
        )


def check_chimera_layout(schedule: str, stages: int, replicas: int) -> None:
    """Chimera pairs process ``i`` with process ``stages - 1 - i`` (they hold the same two stages), and
    does not combine with data-parallel replicas of the pipeline."""
    if not traits(schedule).even_stages and traits(schedule).replicas:
        return
    if traits(schedule).even_stages and (stages < 2 or stages % 2):
        raise LayoutRefused(
            f"schedule='chimera' needs an even number of pipeline stages >= 2 (process i holds stage i of the down "
            f"pipeline and stage {max(stages, 2) - 1}-i of the up one), got {stages}. Use devices (or stages=) 2, 4, "
            "6, ..., or schedule='1f1b'."
        )
    if not traits(schedule).replicas and replicas > 1:
        raise LayoutRefused(
            f"schedule='chimera' does not combine with data-parallel replicas (stages={stages} on "
            f"{stages * replicas} processes): its two pipelines already hold each stage twice. Run it with stages "
            "equal to the number of processes, or use schedule='1f1b' (or 'zero_bubble') with replicas."
        )


def check_async(
    schedule: str,
    module: nn.Module,
    shared: Sequence[nn.Parameter],
    tied: bool,
    stages: int,
    num_microbatches: int,
    scaler: Any,
    blocks: str | None = None,
) -> None:
    """The asynchronous schedules stash (or predict) versions of each stage's weights and apply gradients
    late. Parameters outside the split layers (``shared``: a block container's embeddings, final norm and
    head, whose module is ``module=``'s ``blocks``; a Sequential's pre- and post-processing) take the
    versions of the stage that uses them (:mod:`lightning_pipe.runtime.asynchronous.versions`): nothing to refuse
    there. A weight tied across stages is refused where the stages' delays differ."""
    if tied and traits(schedule).refuses_ties:
        raise LayoutRefused(
            f"schedule={schedule!r} applies gradients with a different delay on each stage, so the copies of a "
            "weight tied across stages would drift apart. Use schedule='pipedream_2bw' (the same delay on every "
            "stage) or untie the weights."
        )
    needed = min_chunks(schedule, stages)
    if num_microbatches < needed:
        raise LayoutRefused(
            f"schedule={schedule!r} keeps two weight versions, which needs chunks >= stages - 1; got "
            f"chunks={num_microbatches} with {stages} stages. Use chunks >= {needed} or "
            "schedule='pipedream'. (A shorter last batch of an epoch is fine: it runs drained.)"
        )
    if scaler is not None:
        raise LayoutRefused(
            f"schedule={schedule!r} applies gradients a step late, when the loss scale of "
            "precision='16-mixed' may have changed. Use precision='bf16-mixed' or a synchronous schedule."
        )
