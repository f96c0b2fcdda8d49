"""The line a run prints once the model is split: how it was split and run. The wording is a pure
function of plain values, tested without processes; :func:`describe_layout` reads from the Trainer
what only it knows.

The line is emitted with Lightning's ``rank_zero_info``, so it appears where Lightning's own setup
lines do (``GPU available: ...``), in a plain script as under Hydra, without any logging setup. What
crosses a boundary beside the hidden state is known only to the process whose stage sends it: each
prints its own boundaries' lines once (:func:`tells_crossing`, :func:`rank_info`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_pipe.partition.solvers.rank_order import describe_order
from lightning_pipe.runtime.topology import Layout
from lightning_pipe.schedules.text import is_schedule_text
from lightning_pipe.schedules.traits import text_traits


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun.endswith('s') else 's'}"


def _listed(numbers: Sequence[int]) -> str:
    text = [str(n) for n in numbers]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " and " + text[-1]


def layout_line(
    processes: int,
    replicas: int,
    balance: Sequence[int],
    first_stages: Sequence[int],
    schedule: str,
    chunks: int,
    global_batch: int | None = None,
    summary: bool = False,
) -> str:
    """One line: how the model was split and run. ``processes``: pipeline depth (processes per
    replica); ``balance``: layers per stage, ``processes x virtual stages`` entries; ``first_stages``:
    the stages rank 0 holds; ``global_batch``: samples per optimizer step over all replicas, where
    known; ``summary``: Lightning prints a model summary, which counts rank 0's stages only."""
    stages = len(balance)
    virtual = stages // processes
    if virtual > 1:
        shape = (
            f"{_plural(processes, 'process')} x {virtual} virtual stages = {stages} stages "
            f"(process 0 holds stages {_listed(first_stages)})"
        )
    else:
        shape = _plural(stages, "stage")
    shape += f" x {_plural(replicas, 'replica')} ({_plural(processes * replicas, 'process')})" if replicas > 1 else ""
    if virtual == 1 and replicas == 1:
        shape += f" ({_plural(processes, 'process')})"
    name = text_traits(schedule).label if is_schedule_text(schedule) else schedule
    parts = [shape, f"layers per stage {list(balance)}", f"schedule {name}", _plural(chunks, "chunk")]
    if global_batch is not None:
        parts.append(f"global batch {global_batch}")
    line = "lightning-pipe: " + ", ".join(parts)
    if summary and stages > 1:
        held = f"stage {first_stages[0]}" if len(first_stages) == 1 else f"stages {_listed(first_stages)}"
        line += f"; the model summary below counts rank 0's {held} only"
    return line


def tells_crossing(stage: int, stages: int, replica: int, mirrored: bool) -> bool:
    """Whether the runner of schedule stage ``stage`` (of ``stages``) prints what crosses its boundary
    beside the hidden state: each boundary of the split once, from the process that runs it (only it
    sees what its blocks record), of replica 0 (the replicas send alike), and under Chimera from the
    first copy's stage (the second copy, stages ``stages / 2`` on, runs the same blocks)."""
    return replica == 0 and stage < (stages // 2 if mirrored else stages)


def rank_info(rank: int) -> Callable[[str], None]:
    """Where a process prints a line only it knows: rank 0's through ``rank_zero_info``, as the layout
    line; another rank's through the same logger, prefixed with its rank (as Lightning prefixes the
    lines of other ranks), since ``rank_zero_info`` drops them."""
    if rank == 0:
        return rank_zero_info
    logger = logging.getLogger("lightning.pytorch")
    return lambda line: logger.info(rank_prefixed_message(line, rank))


def loader_batch_size(trainer: Any) -> int | None:
    """The training DataLoader's batch size when ``fit`` was given the DataLoader itself (a
    DataModule's loader does not exist yet when the model is split, and calling the user's
    ``train_dataloader()`` just for a log line could have side effects)."""
    from lightning.pytorch.trainer.states import TrainerFn
    from torch.utils.data import DataLoader

    from lightning_pipe.trainer import internals

    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return None
    loader = getattr(internals.data_source(trainer.fit_loop), "instance", None)
    size = loader.batch_size if isinstance(loader, DataLoader) else None
    return size if isinstance(size, int) else None


def shows_model_summary(trainer: Any) -> bool:
    """Whether Lightning will print a model summary (it does when fitting, on rank 0)."""
    from lightning.pytorch.callbacks import ModelSummary
    from lightning.pytorch.trainer.states import TrainerFn

    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return False
    return any(isinstance(callback, ModelSummary) for callback in trainer.callbacks)


def describe_layout(
    trainer: Any,
    layout: Layout,
    balance: Sequence[int],
    positions: Sequence[int],
    schedule: str,
    chunks: int,
) -> str:
    """:func:`layout_line` for a Trainer being set up; ``positions[s]`` is the pipeline position
    (process) that holds stage ``s``; Chimera's copies (stages ``len(balance)`` and up) are named by
    the split stage they copy, so a 2-process run reads "stages 0 and 1". A placed ``layout`` (on
    unequal devices) adds which ranks hold each position."""
    size, replicas, home = loader_batch_size(trainer), layout.replicas, layout.stage_of(0)
    first = sorted({s % len(balance) for s, position in enumerate(positions) if position == home})
    line = layout_line(
        layout.stages, replicas, balance, first, schedule, chunks, size * replicas if size is not None else None,
        shows_model_summary(trainer),
    )  # fmt: skip
    if layout.is_placed:
        line += f"; ranks placed: {describe_order(layout.order, layout.stages, replicas)}"
    return line


def activations_part(recompute: Sequence[str], offload: Sequence[int | None], predicted: Sequence[int] = ()) -> str:
    """``; activations per stage: ...``: each stage's recompute mode or offload (with the planner's
    predicted peak of saved activations where it planned them); empty where every stage keeps them all."""
    if all(m == "never" for m in recompute) and all(k is None for k in offload):
        return ""
    parts = []
    for stage, (mode, keep) in enumerate(zip(recompute, offload)):
        recomputed = [] if mode == "never" else [mode]
        label = ", ".join(recomputed + ([] if keep is None else [f"offload k={keep}"])) or "keep"
        peak = f" ({predicted[stage] / 2**20:.2f} MiB predicted)" if stage < len(predicted) else ""
        parts.append(f"stage {stage} {label}{peak}")
    return "; activations per stage: " + ", ".join(parts)
