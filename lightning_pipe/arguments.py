"""The strategy's arguments, checked where the user wrote them: before any process starts, with
an error that names the bad value and the valid ones."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from lightning_pipe.partition.split import BALANCE_MODES, BalanceSpec
from lightning_pipe.runtime.stage import CHECKPOINT_MODES
from lightning_pipe.runtime.topology import check_layout_arguments
from lightning_pipe.schedules import check_virtual_stages, get_schedule
from lightning_pipe.weights import check_weights_argument

PLANS = (None, "auto")


def check_arguments(
    schedule: str,
    chunks: Optional[int],
    balance: BalanceSpec,
    checkpoint: str,
    weights: Optional[Union[str, Path]] = None,
    virtual_stages: Optional[int] = None,
    *,
    stages: Optional[int] = None,
    data_parallel: str = "replicate",
    plan: Optional[str] = None,
    check_data: Union[bool, int] = True,
) -> None:
    """Reject bad ``PipelineStrategy`` arguments, naming the valid values."""
    get_schedule(schedule)
    check_weights_argument(weights)
    check_layout_arguments(stages, data_parallel)
    if virtual_stages is not None:
        check_virtual_stages(schedule, virtual_stages)
    if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise ValueError(f"PipelineStrategy(chunks={chunks!r}): chunks is the number of micro-batches per batch and must be an integer >= 1.")
    if isinstance(balance, str):
        if balance not in BALANCE_MODES:
            raise ValueError(
                f"PipelineStrategy(balance={balance!r}): unknown balance. Valid: {', '.join(BALANCE_MODES)}, "
                "or a list of layer counts per stage."
            )
    elif not isinstance(balance, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool) for n in balance):
        raise ValueError(
            f"PipelineStrategy(balance={balance!r}): give one of {', '.join(BALANCE_MODES)}, or a list of layer counts per stage."
        )
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"PipelineStrategy(checkpoint={checkpoint!r}): unknown mode. Valid: {', '.join(CHECKPOINT_MODES)}.")
    if plan not in PLANS:
        raise ValueError(f"PipelineStrategy(plan={plan!r}): valid values are None (use the arguments as given) and 'auto'.")
    if not isinstance(check_data, int) or (not isinstance(check_data, bool) and check_data < 1):
        raise ValueError(
            f"PipelineStrategy(check_data={check_data!r}): give True (compare a checksum of the stages' batches "
            "every step), an integer N >= 1 (every N steps and the first of each epoch) or False (shapes only)."
        )


__all__ = ["PLANS", "check_arguments"]
