"""Averaging a stage's gradients over its data-parallel replicas while the backward still runs.

As in DDP, the stage's parameters are grouped into buckets (in backward order, about
``bucket_bytes`` each), and a bucket's all-reduce starts as soon as every parameter in it has
received its last micro-batch's gradient, overlapping the remaining backward work of the step.
Each parameter is reduced once per step, never once per micro-batch.

A parameter's gradient is final when it has been accumulated as many times as the step has
micro-batches times the parameter's uses per micro-batch (:class:`Accumulations`; a parameter
used twice per micro-batch accumulates twice). Batches change size (a short first or last batch,
a sampler with a token budget), so the expected count is decided per step from that step's
micro-batch count; only the uses per micro-batch, a property of the model, are learned, in the
first step, which reduces everything after its backward (later steps overlap). Readiness is
observed with post-accumulate-grad hooks, which fire for layers under gradient-accumulation
fusion too (the fused product writes ``.grad``; the hook runs after it, see
:mod:`lightning_pipe.runtime.grads.fused_linear`, which ignores these hooks when deciding to fuse).
Like DDP's ``static_graph``, this assumes every micro-batch uses each parameter the same number of
times; a step that accumulates a parameter again after its bucket was sent is an error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_pipe.runtime.grads.flat import FlatAllReduce

#: Attribute marking our hooks, so gradient-accumulation fusion knows they do not observe gradients.
HOOK_TAG = "_lightning_pipe_readiness"


class Accumulations:
    """How many gradient accumulations each parameter (keyed by ``id``) gets in a step: its uses
    per micro-batch times the step's micro-batches (:meth:`start`). The uses are learned from the
    first step's counts (:meth:`learn`); a parameter whose count there is not a multiple of the
    micro-batches (used by some micro-batches only) has no expected count: it is averaged after the
    backward. Pure bookkeeping, no communication."""

    def __init__(self) -> None:
        self.uses: dict[int, int | None] | None = None
        self.microbatches = 1
        self.per_param: dict[int, int] = {}
        self.expected: dict[int, int] | None = None  # this step's final counts; None in the first step

    def start(self, microbatches: int, per_param: Mapping[int, int] | None = None) -> None:
        """A step of ``microbatches`` micro-batches begins; ``per_param``: the micro-batches that reach
        the parameters it names, where not all of them do (Chimera: each copy of a stage sees its own
        pipeline's)."""
        self.microbatches = max(1, microbatches)
        self.per_param = dict(per_param) if per_param else {}
        if self.uses is not None:
            self.expected = {key: uses * self._reaching(key) for key, uses in self.uses.items() if uses is not None}

    def _reaching(self, key: int) -> int:
        return self.per_param.get(key, self.microbatches)

    def learn(self, counts: dict[int, int]) -> None:
        """The step is over: the first step's ``counts`` give the uses per micro-batch."""
        if self.uses is None:
            self.uses = {}
            for key, count in counts.items():
                m = self._reaching(key)
                self.uses[key] = count // m if m > 0 and count % m == 0 else None

    def final(self, key: int, count: int, shape: Sequence[int]) -> bool:
        """Whether ``count`` accumulations so far make the parameter's gradient final in this step;
        past that count its average has already started, which is an error."""
        expected = self.expected.get(key) if self.expected is not None else None
        if expected is None:
            return False
        if count > expected:
            raise RuntimeError(
                f"A parameter of shape {tuple(shape)} received {count} gradient accumulations in a step of "
                f"{self.microbatches} micro-batches, where the first step gave it {expected // self.microbatches} per "
                "micro-batch: its average over the data-parallel replicas had already started. Under "
                "data_parallel='replicate' every micro-batch must use each parameter as often as the first step's "
                "did. For a branch that only some batches take, run it in every micro-batch and multiply its "
                "result by zero where it does not apply."
            )
        return count == expected

    def ready(self, key: int, count: int) -> bool:
        """Whether the parameter's gradient is final (never, for one without an expected count)."""
        return self.expected is not None and count == self.expected.get(key, -1)


class ReplicaReducer:
    """Bucketed, overlapped all-reduce (mean) of one stage's gradients over ``group``; with ``mean``
    false, the sum (the two copies of a Chimera stage, each with its own micro-batches' gradient)."""

    def __init__(
        self, params: Sequence[nn.Parameter], group: ProcessGroup, bucket_bytes: int = 25 * 2**20, mean: bool = True
    ) -> None:
        self.group = group
        self.summed = not mean
        self.replicas = dist.get_world_size(group) if mean else 1
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        for param in reversed(self.params):  # the backward visits the last layers first
            if current and (size >= bucket_bytes or param.dtype != current[-1].dtype):
                self.buckets.append(current)
                current, size = [], 0
            current.append(param)
            size += param.numel() * param.element_size()
        if current:
            self.buckets.append(current)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.accumulations = Accumulations()
        self._counts: dict[int, int] = {}
        self._active = False
        self._next = 0
        self._works: list[FlatAllReduce] = []
        self._handles = []
        #: per step: (buckets sent from within the backward, buckets sent in all)
        self.history: list[tuple[int, int]] = []
        self._early = 0
        for param in self.params:
            hook = self._hook
            self._handles.append(param.register_post_accumulate_grad_hook(_tagged(hook)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def start(self, microbatches: int, per_param: Mapping[int, int] | None = None) -> None:
        """A step's backward of ``microbatches`` micro-batches begins: count accumulations from zero
        (``per_param``: see :meth:`Accumulations.start`)."""
        self.accumulations.start(microbatches, per_param)
        self._counts = {id(p): 0 for p in self.params}
        self._active = True
        self._next = 0
        self._works = []
        self._early = 0

    def _hook(self, param: Tensor) -> None:
        if not self._active:
            return
        key = id(param)
        count = self._counts[key] = self._counts.get(key, 0) + 1
        if self.accumulations.final(key, count, param.shape):
            self._launch_ready()

    def _bucket_ready(self, index: int) -> bool:
        return all(self.accumulations.ready(id(p), self._counts[id(p)]) for p in self.buckets[index])

    def _launch_ready(self) -> None:
        # in bucket order on every replica, so that the collectives match
        while self._next < len(self.buckets) and self._bucket_ready(self._next):
            self._launch(self._next)
            self._early += 1
            self._next += 1

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        if self.summed:  # a copy that no micro-batch of this step reached adds zeros, and takes its pair's sum
            for param in bucket:
                if param.grad is None and self.accumulations.per_param.get(id(param)) == 0:
                    param.grad = torch.zeros_like(param)
        grads = [p.grad for p in bucket if p.grad is not None]
        if grads:
            self._works.append(FlatAllReduce(grads, self.group))

    def finish(self) -> None:
        """The step's backward is over: send the buckets not sent yet (all of them in the first
        step, whose counts give the uses per micro-batch)."""
        self.accumulations.learn(self._counts)
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        self._active = False
        self.history.append((self._early, len(self._works)))

    def wait(self) -> None:
        """Wait for the sums and leave the replicas' mean in each gradient."""
        works, self._works = self._works, []
        for work in works:
            work.wait(self.replicas)


def _tagged(hook: Any) -> Any:
    def readiness(param: Tensor) -> None:
        hook(param)

    setattr(readiness, HOOK_TAG, True)
    return readiness
