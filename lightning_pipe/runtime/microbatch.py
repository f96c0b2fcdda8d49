"""Split a batch into micro-batches along the first dimension, and describe it.

Batches are whatever a DataLoader yields: tensors, tuples, lists, dicts and namedtuples of them,
nested. Tensors with a batch dimension are split; 0-d tensors and non-tensor leaves (strings,
numbers, None) are given to every micro-batch unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_pipe.schedules.traits import ScheduleTraits

#: Micro-batches per pipeline stage where ``chunks`` is unset (a schedule text runs its own count).
CHUNKS_PER_STAGE = 2


def microbatch_count(chunks: int | None, schedule: ScheduleTraits, num_stages: int) -> int:
    """Micro-batches per batch on a pipeline of ``num_stages``: ``chunks``, or a schedule text's count, or
    :data:`CHUNKS_PER_STAGE` per stage."""
    if chunks is not None:
        return int(chunks)
    return schedule.text.num_microbatches if schedule.text is not None else CHUNKS_PER_STAGE * num_stages


def _map(batch: Any, fn: Callable[[Tensor], Any]) -> Any:
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map(x, fn) for x in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map(x, fn) for x in batch)
    if isinstance(batch, Mapping):
        return type(batch)((k, _map(v, fn)) for k, v in batch.items())  # type: ignore[call-arg]
    return batch


def tensors_of(batch: Any) -> list[Tensor]:
    """The tensor leaves of ``batch`` in a fixed traversal order."""
    found: list[Tensor] = []
    _map(batch, found.append)
    return found


def batch_size(batch: Any) -> int:
    """Size of the first dimension shared by the batch's tensors."""
    sizes = {t.shape[0] for t in tensors_of(batch) if t.dim() > 0}
    if not sizes:
        raise ValueError(
            "The pipeline splits each batch into micro-batches along the first dimension, but this batch holds "
            f"no tensor with a batch dimension (got {type(batch).__name__}). Yield tensors from the DataLoader."
        )
    if len(sizes) > 1:
        raise ValueError(
            f"The batch's tensors disagree on the batch dimension (first dimensions {sorted(sizes)}); the pipeline "
            "splits every tensor along dimension 0, so they must all have the same size there."
        )
    return sizes.pop()


def split_sizes(total: int, chunks: int) -> list[int]:
    """Micro-batch sizes: ``min(chunks, total)`` parts differing by at most one, larger ones first."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    parts = max(1, min(chunks, total))
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split(batch: Any, chunks: int) -> list[Any]:
    """``batch`` as up to ``chunks`` micro-batches (fewer when the batch is smaller than ``chunks``)."""
    sizes = split_sizes(batch_size(batch), chunks)

    def piece(index: int) -> Any:
        start = sum(sizes[:index])

        def cut(t: Tensor) -> Any:
            return t if t.dim() == 0 else t.narrow(0, start, sizes[index])

        return _map(batch, cut)

    return [piece(i) for i in range(len(sizes))]


def merge(outputs: list[Any]) -> Any:
    """The inverse of :func:`split` for step outputs: tensors concatenated along dimension 0 (0-d
    tensors stacked), containers merged item by item, anything else returned as a list."""
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    if first is None and all(o is None for o in outputs):
        return None
    if isinstance(first, Tensor) and all(isinstance(o, Tensor) for o in outputs):
        return torch.stack(outputs) if first.dim() == 0 else torch.cat(outputs)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(merge([o[i] for o in outputs]) for i in range(len(first))))
    if isinstance(first, (list, tuple)) and all(isinstance(o, type(first)) and len(o) == len(first) for o in outputs):
        return type(first)(merge([o[i] for o in outputs]) for i in range(len(first)))
    if isinstance(first, Mapping) and all(isinstance(o, Mapping) and o.keys() == first.keys() for o in outputs):
        return type(first)((k, merge([o[k] for o in outputs])) for k in first)  # type: ignore[call-arg]
    return list(outputs)


def signature(batch: Any) -> tuple:
    """Shapes and dtypes of the batch's tensors: the key under which activation shapes are cached."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors_of(batch))


def as_tuple(value: Any) -> tuple[tuple[Tensor, ...], bool]:
    """An activation as a tuple of tensors, and whether it was a tuple to begin with."""
    if isinstance(value, Tensor):
        return (value,), False
    if isinstance(value, (tuple, list)) and all(isinstance(v, Tensor) for v in value):
        return tuple(value), True
    kinds = type(value).__name__ if not isinstance(value, (tuple, list)) else [type(v).__name__ for v in value]
    raise TypeError(
        f"A pipeline stage must output a tensor or a tuple of tensors to pass to the next stage, got {kinds}. "
        "Return masks and other extras as tensors in a tuple."
    )


def from_tuple(tensors: tuple[Tensor, ...], was_tuple: bool) -> Any:
    return tensors if was_tuple else tensors[0]
