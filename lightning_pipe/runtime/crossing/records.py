"""Values that the user's own forward hooks record on a layer, read by the step's loss on the last stage.

A forward hook on an early layer whose output the loss reads (intermediate supervision, feature
matching) runs on the stage that holds the layer; under the pipeline the loss runs on the last stage.
:func:`recording` is such a hook made explicit: the value it records travels from the recording stage
to the last stage as a skip connection does (:mod:`lightning_pipe.runtime.crossing.skips`, popped after
the Sequential's last layer), its gradient back, and :func:`recorded` reads it in the step. Without the
pipeline the same two calls keep and read the value in this process, so the model trains alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn

from lightning_pipe.runtime.crossing.skips import active_scope

#: what the recording hooks recorded where no stage's skip scope is active (plain training, the last stage)
_records: dict[str, Tensor] = {}


class Recording:
    """A forward hook that records its module's output under ``name`` (see :func:`recording`)."""

    def __init__(self, name: str) -> None:
        self.recorded_name = name  # what the split's skip routes look for (skips.recorded_names)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if not isinstance(output, Tensor):
            raise TypeError(f"recording({self.recorded_name!r}) records a tensor; {type(module).__name__} returned "
                            f"{type(output).__name__}.")  # fmt: skip
        scope = active_scope()
        (_records if scope is None else scope)[self.recorded_name] = output


def recording(name: str) -> Recording:
    """A forward hook recording its module's output under ``name``, for :func:`recorded` in the step::

    self.layers[1].register_forward_hook(lightning_pipe.recording("features"))
    """
    return Recording(name)


def recorded(name: str) -> Tensor:
    """The value a :func:`recording` hook recorded under ``name`` in this forward (on the last stage
    under the pipeline, received with the micro-batch from the stage that recorded it)."""
    if name not in _records:
        raise RuntimeError(
            f"No recording({name!r}) hook recorded a value in this forward. Register it on a layer of the "
            f"Sequential that runs before the step reads it: layer.register_forward_hook(recording({name!r}))."
        )
    return _records[name]


def keep_records(values: Iterable[tuple[str, Tensor]]) -> None:
    """The last stage: the recorded values received (or recorded by its own layers) for the step to read."""
    _records.update(values)
