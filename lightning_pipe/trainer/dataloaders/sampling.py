"""The same sample order on every stage of a pipeline, whatever the sampler.

Every stage loads each batch itself: the first stage feeds the inputs to the model, the last one
gives the targets to the loss. They must therefore draw the very same indices. A sampler that
draws from the process's random state (``WeightedRandomSampler``, ``SubsetRandomSampler``, a
``RandomSampler`` without a generator, custom ones using ``random`` or ``numpy``) drifts apart as
soon as a stage consumes random numbers the others do not (dropout on one stage is enough), and
training goes on silently against the wrong labels.

So the first stage's sampler is the only one that draws: :class:`SharedOrder` wraps the
DataLoader's index sampler and sends each batch's indices from the first stage to the others,
which yield what they receive. The sends do not block (the first stage runs ahead of the others),
and samplers that cannot differ between processes (sequential ones, ``DistributedSampler``) are
left alone.
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from lightning_pipe.torch_internals import lightning_wrapped_batch_sampler

#: Tag of the index messages, apart from the activation headers on the same group.
TAG = 0x5A3D
_INTS, _PICKLED, _END = 0, 1, 2
_MAX_IN_FLIGHT = 4  # batches whose sends stay open on the first stage before it waits for the oldest
_END_OF_PASS = object()


def is_deterministic(sampler: Any) -> bool:
    """Whether ``sampler`` yields the same order in every process (no per-process randomness)."""
    if isinstance(sampler, (SequentialSampler, DistributedSampler)):
        return True
    if isinstance(sampler, BatchSampler):  # a subclass that skipped BatchSampler.__init__ has no sampler
        return hasattr(sampler, "sampler") and is_deterministic(sampler.sampler)
    inner = lightning_wrapped_batch_sampler(sampler)
    if inner is not None:
        return is_deterministic(inner)
    return isinstance(sampler, (range, list, tuple))


class SharedOrder:
    """An index sampler (batch sampler, or plain sampler when batching is off) whose order is the
    first stage's on every stage of the pipeline.

    ``group`` holds the pipeline's stages; ``src`` is the global rank of its first stage.
    Attributes other than iteration (``sampler``, ``batch_size``, ``set_epoch`` ...) are those of
    the wrapped sampler, so Lightning and the DataLoader see it as before.
    """

    def __init__(self, inner: Any, group: ProcessGroup | None, src: int, peers: Sequence[int]) -> None:
        self.inner = inner
        self.group = group
        self.src = src
        self.peers = [p for p in peers if p != src]
        self.is_src = dist.get_rank() == src
        self._iteration = 0
        self._sends: deque[tuple[Any, Tensor]] = deque()

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not yet set (unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        self._iteration += 1
        return self._send_order() if self.is_src else self._receive_order()

    # ------------------------------------------------------------------ first stage
    def _send_order(self) -> Iterator[Any]:
        count = 0
        for item in self.inner:
            self._send(count, item)
            count += 1
            yield item
        self._send(count, _END_OF_PASS)

    def _send(self, count: int, item: Any) -> None:
        indices = _index_list(item)
        if item is _END_OF_PASS:
            kind, payload = _END, None
        elif indices is not None:
            kind, payload = _INTS, torch.tensor(indices, dtype=torch.int64)
        else:
            kind, payload = _PICKLED, torch.frombuffer(bytearray(pickle.dumps(item)), dtype=torch.uint8)
        size = 0 if payload is None else payload.numel()
        header = torch.tensor([self._iteration, count, kind, size], dtype=torch.int64)
        for peer in self.peers:
            self._sends.append((dist.isend(header, peer, group=self.group, tag=TAG), header))
            if payload is not None and size:
                self._sends.append((dist.isend(payload, peer, group=self.group, tag=TAG), payload))
        while len(self._sends) > _MAX_IN_FLIGHT * 2 * len(self.peers):
            self._sends.popleft()[0].wait()

    # ------------------------------------------------------------------ other stages
    def _receive_order(self) -> Iterator[Any]:
        count = 0
        while True:
            iteration, number, kind, item = self._receive()
            if iteration < self._iteration:  # left over from an iteration abandoned early
                continue
            if (iteration, number) != (self._iteration, count):
                raise RuntimeError(
                    f"The pipeline's stages lost step over the DataLoader: stage at rank {dist.get_rank()} expected "
                    f"batch {count} of pass {self._iteration} over it, the first stage sent batch {number} of pass "
                    f"{iteration}. Every stage must iterate the training DataLoader the same number of times."
                )
            if kind == _END:
                return
            count += 1
            yield item

    def _receive(self) -> tuple[int, int, int, Any]:
        header = torch.empty(4, dtype=torch.int64)
        dist.recv(header, self.src, group=self.group, tag=TAG)
        iteration, number, kind, size = header.tolist()
        if kind == _END:
            return iteration, number, kind, None
        payload = torch.empty(size, dtype=torch.int64 if kind == _INTS else torch.uint8)
        if size:
            dist.recv(payload, self.src, group=self.group, tag=TAG)
        if kind == _PICKLED:
            return iteration, number, kind, pickle.loads(payload.numpy().tobytes())
        return iteration, number, kind, payload.tolist()


def _index_list(item: Any) -> list[int] | None:
    """A batch sampler's usual item, a list of ints, as such; anything else is sent pickled."""
    if isinstance(item, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in item):
        return item
    return None


def share_order(dataloader: object, group: ProcessGroup | None, src: int, peers: Sequence[int]) -> object:
    """Make every stage of the pipeline (``peers``, first stage ``src``) iterate ``dataloader``'s
    indices in the first stage's order. Changes the DataLoader in place; returns it."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset) or len(peers) < 2:
        return dataloader
    attribute = "batch_sampler" if dataloader.batch_sampler is not None else "sampler"
    current = getattr(dataloader, attribute)
    if isinstance(current, SharedOrder) or is_deterministic(current):
        return dataloader
    # the DataLoader forbids setting its samplers after construction; the iterator only reads them
    object.__setattr__(dataloader, attribute, SharedOrder(current, group, src, peers))
    return dataloader
