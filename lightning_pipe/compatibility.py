"""What a run's layout allows, checked in setup before the first batch: the schedule each step
executes (proven to finish on the process group's backend), and the combinations of schedule,
sharding, tied weights, parameters outside the Sequential and precision that cannot train, each
refused with the reason and what to change."""

from __future__ import annotations

from typing import Any, Sequence

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_pipe.schedules import (
    REGROUPED_FOR_RENDEZVOUS,
    VIRTUAL_STAGES,
    InvalidScheduleError,
    RendezvousError,
    Schedule,
    build,
    for_rendezvous,
    forward_only,
    forward_only_like,
    is_async,
    validate,
)
from lightning_pipe.schedules.asynchronous import min_chunks


def run_schedule(training: str, name: str, stages: int, num_microbatches: int, virtual_stages: int, rendezvous: bool) -> Schedule:
    """Schedule ``name`` (``"forward"`` for evaluation, on the layout of the ``training`` schedule)
    for ``num_microbatches``, validated; with ``rendezvous`` (NCCL, whose point-to-point calls
    rendezvous) with its communication regrouped where it needs it."""
    p, v = stages, virtual_stages
    under = " under NCCL (whose point-to-point calls rendezvous)" if rendezvous else ""
    try:
        if name != "forward":
            schedule = build(name, p, num_microbatches, v, rendezvous=rendezvous)
        elif training in VIRTUAL_STAGES:  # evaluation on the training layout
            schedule = forward_only_like(build(training, p, num_microbatches, v))
            if rendezvous and training in REGROUPED_FOR_RENDEZVOUS:
                schedule = for_rendezvous(schedule)
        else:
            schedule = forward_only(p, num_microbatches)
        validate(schedule, rendezvous=rendezvous)
    except RendezvousError as err:
        raise MisconfigurationException(
            f"schedule={training!r} with {p} processes and {num_microbatches} micro-batches cannot "
            f"run{under}: {err}. With this few micro-batches a process waits for its own output to come "
            f"back around the pipeline. Use other chunks (checked: >= {p} for 'interleaved_1f1b', a multiple of "
            f"{p} for 'interleaved_zero_bubble', >= {max(1, 2 * p - 2)} for 'zbv'; with a short last batch, "
            "drop_last=True in the DataLoader), "
            "or schedule='1f1b' or 'zero_bubble'."
        ) from err
    except InvalidScheduleError as err:
        raise MisconfigurationException(
            f"schedule={training!r} with {p} processes and {num_microbatches} micro-batches cannot "
            f"run{under}: {err}. Use schedule='1f1b' or 'zero_bubble', or other chunks."
        ) from err
    return schedule


def check_shard(schedule: str, shared: Sequence[nn.Parameter], tied: bool) -> None:
    """``data_parallel='shard'`` (FSDP2) shards the stage's layers only and keeps one weight version."""
    problems = []
    if is_async(schedule):
        problems.append(f"schedule={schedule!r} keeps weight versions, which sharded weights do not have")
    if any(p.requires_grad for p in shared):
        problems.append("the module has trainable parameters outside the split nn.Sequential")
    if tied:
        problems.append("weights are tied across stages")
    if problems:
        raise MisconfigurationException(
            "PipelineStrategy(data_parallel='shard') cannot run here: " + "; ".join(problems)
            + ". Use data_parallel='replicate' (or a synchronous schedule, the layers inside the Sequential, untied weights)."
        )


def check_async(
    schedule: str, module: nn.Module, shared: Sequence[nn.Parameter], tied: bool, stages: int, num_microbatches: int, scaler: Any
) -> None:
    """The asynchronous schedules stash versions of the Sequential's weights and apply gradients late."""
    outside = [p for p in shared if p.requires_grad]
    if outside:
        names = [n for n, p in module.named_parameters() if any(p is q for q in outside)]
        raise MisconfigurationException(
            f"schedule={schedule!r} stashes weight versions of the split nn.Sequential only, but "
            f"{type(module).__name__} has trainable parameters outside it ({', '.join(names[:4])}). Move those "
            "layers into the Sequential, or use a synchronous schedule ('gpipe' or '1f1b')."
        )
    if tied and schedule == "pipedream":
        raise MisconfigurationException(
            "schedule='pipedream' applies gradients with a different delay on each stage, so the copies of a "
            "weight tied across stages would drift apart. Use schedule='pipedream_2bw' (the same delay on every "
            "stage) or untie the weights."
        )
    needed = min_chunks(schedule, stages)
    if num_microbatches < needed:
        raise MisconfigurationException(
            f"schedule={schedule!r} keeps two weight versions, which needs chunks >= stages - 1; got "
            f"chunks={num_microbatches} with {stages} stages. Use chunks >= {needed} or "
            "schedule='pipedream'. (A shorter last batch of an epoch is fine: it runs drained.)"
        )
    if scaler is not None:
        raise MisconfigurationException(
            f"schedule={schedule!r} applies gradients a step late, when the loss scale of "
            "precision='16-mixed' may have changed. Use precision='bf16-mixed' or a synchronous schedule."
        )


__all__ = ["check_async", "check_shard", "run_schedule"]
