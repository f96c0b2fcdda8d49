"""Gradient arithmetic shared by the pipeline's gradient paths: accumulating into ``.grad`` as
autograd does, and reducing many tensors with one collective.

One all-reduce per bucket of tensors instead of one per tensor: each collective has a fixed cost
(a launch, a rendezvous, on gloo a round trip), which dominates for the many small tensors of a
stage (biases, norms). The tensors are flattened into one buffer, reduced, and copied back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


def add_grad(param: Tensor, grad: Tensor) -> None:
    """Accumulate ``grad`` into ``param.grad`` as autograd's ``AccumulateGrad`` does (``grad`` may
    become ``param.grad``)."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class FlatAllReduce:
    """A sum of ``tensors`` (one dtype) over ``group`` as one flat buffer, started at once (with
    ``async_op``, overlapping what the caller does next); :meth:`wait` leaves the result in the
    tensors themselves."""

    def __init__(self, tensors: Sequence[Tensor], group: ProcessGroup | None = None, async_op: bool = True) -> None:
        self.tensors = list(tensors)
        self.flat = torch.cat([t.reshape(-1) for t in self.tensors])
        self.work = dist.all_reduce(self.flat, group=group, async_op=async_op)

    def wait(self, divisor: int = 1) -> list[Tensor]:
        """Wait for the sum and copy it, divided by ``divisor`` (the replicas, for a mean), back
        into the tensors; returns them."""
        if self.work is not None:
            self.work.wait()
        if divisor != 1:
            self.flat.div_(divisor)
        offset = 0
        for tensor in self.tensors:
            n = tensor.numel()
            tensor.copy_(self.flat[offset : offset + n].view_as(tensor))
            offset += n
        return self.tensors
