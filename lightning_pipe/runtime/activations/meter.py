"""Measure the activations autograd keeps for the backward, on any device.

:class:`SavedActivationMeter` counts, through saved-tensor hooks, the bytes of every tensor saved
for a backward while it is alive (a tensor saved by several operations counts once; each
micro-batch's slice of a batch counts for its own bytes; parameters and tensors sharing their
memory do not count), and keeps the peak. It is what the benchmarks use to
compare schedules and recompute modes; it is off unless a stage runner is given one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


class _Saved:
    __slots__ = ("__weakref__", "key", "meter", "tensor")

    def __init__(self, meter: SavedActivationMeter, key: tuple[int, int], tensor: Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter.release(self.key)


class SavedActivationMeter:
    def __init__(self, parameters: Iterable[nn.Parameter] = ()) -> None:
        self.current = 0
        self.peak = 0
        self._live: dict[tuple[int, int], list[int]] = {}
        self._ignore = {p.untyped_storage().data_ptr() for p in parameters}

    def ignore(self, parameters: Iterable[Tensor]) -> None:
        """Do not count tensors sharing memory with ``parameters`` (weights, weight versions)."""
        self._ignore.update(p.untyped_storage().data_ptr() for p in parameters)

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` more (fewer, when negative) held for a backward outside the hooks: saved
        tensors brought back from host memory (:mod:`lightning_pipe.runtime.activations.offload`)."""
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def ignored(self) -> set[int]:
        """The storages not counted (parameters, weight versions), for other hooks that defer to this meter."""
        return self._ignore

    def saved_of(self, tensors: Iterable[Tensor]) -> int:
        """Bytes of ``tensors`` (each once) that are saved now, as they are (not a view of them)."""
        keys = {(t.data_ptr(), t.numel() * t.element_size()) for t in tensors}
        return sum(self._live[key][1] for key in keys if key in self._live)

    @contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: Tensor) -> object:
        if tensor.untyped_storage().data_ptr() in self._ignore or isinstance(tensor, nn.Parameter):
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        key = (tensor.data_ptr(), nbytes)
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [0, nbytes]
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Saved(self, key, tensor)

    @staticmethod
    def _unpack(saved: object) -> Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved  # type: ignore[return-value]

    #: the hooks' two halves, for other saved-tensor hooks that count through this meter
    pack = _pack
    unpack = _unpack

    def release(self, key: tuple[int, int]) -> None:
        """One saved hold on the tensor ``key`` ends (autograd dropped what ``pack`` gave it)."""
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]
