"""A recomputed forward must not change a stage's state a second time.

Activation recomputation (``recompute="always"``/``"except_last"``) runs a micro-batch's forward
again during its backward. Layers that update buffers in training would count that micro-batch
twice: BatchNorm's ``num_batches_tracked`` would end at twice plain training's and its running
mean and variance would move twice per micro-batch. So the forward records which buffers it
changed in place (their version counters moved), and the recomputation puts those buffers back as
it found them once it is done. Whatever a layer mutates, BatchNorm or not, gets the same care, and
only those buffers are copied (not, say, a large attention mask that no forward touches). The one
exception to the version counters: the batch-norm kernels update ``running_mean`` and
``running_var`` without moving them, so buffers of those names are always kept.

The recomputation itself sees the buffers as they are when it runs (after the forwards of later
micro-batches): BatchNorm in training normalises with the micro-batch's own statistics, so its
output does not depend on them.
"""

from __future__ import annotations

import typing
from types import TracebackType
from typing import Literal

from torch import Tensor, nn

from lightning_pipe.torch_internals import version

#: ``recompute=``: every micro-batch, every one but the last, or none
RecomputeMode = Literal["always", "except_last", "never"]
RECOMPUTE_MODES: tuple[RecomputeMode, ...] = typing.get_args(RecomputeMode)

#: buffers that ``torch.batch_norm`` updates in place without moving their version counter
_STATISTICS = ("running_mean", "running_var")


class _Forward:
    """Entered around the forward: notes which buffers it changed in place."""

    def __init__(self, module: nn.Module, changed: list[Tensor]) -> None:
        named = list(module.named_buffers())
        self.buffers = [b for _, b in named]
        self.statistics = [b for name, b in named if name.rsplit(".", 1)[-1] in _STATISTICS]
        self.changed = changed
        self.versions: list[int] = []

    def __enter__(self) -> None:
        self.versions = [version(b) for b in self.buffers]

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        kept = {id(b) for b in self.statistics}
        moved = [b for b, v in zip(self.buffers, self.versions) if version(b) != v and id(b) not in kept]
        self.changed[:] = self.statistics + moved


class _Recomputation:
    """Entered around the recomputation: puts back the buffers the forward changed. Also on the way
    out of an early-stopped recomputation, which ends with an exception inside it."""

    def __init__(self, changed: list[Tensor]) -> None:
        self.changed = changed
        self.saved: list[Tensor] = []

    def __enter__(self) -> None:
        self.saved = [b.clone() for b in self.changed]

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        # through ``.data``: the version counter stays, as the batch-norm kernels leave it, since the
        # graph of a micro-batch that was not recomputed (``except_last``) saved the running
        # statistics (a backward in training never reads them) and would refuse a moved counter
        for buffer, value in zip(self.changed, self.saved):
            buffer.data.copy_(value)
        self.saved = []


def keep_buffers(module: nn.Module) -> tuple[_Forward, _Recomputation]:
    """The (forward, recomputation) context managers for ``torch.utils.checkpoint``'s ``context_fn``:
    the recomputation of ``module``'s forward leaves its buffers as it found them."""
    changed: list[Tensor] = []
    return _Forward(module, changed), _Recomputation(changed)
