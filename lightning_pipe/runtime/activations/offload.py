"""Saved activations moved to host memory between a micro-batch's forward and its backward.

A pipeline stage keeps each micro-batch's saved tensors from its forward to its backward; under 1F1B
stage ``s`` of ``p`` holds ``p - s`` micro-batches at its peak while the last stage holds one. With
``offload`` a stage keeps at most ``keep`` micro-batches' saved tensors in device memory: the forward
of any micro-batch beyond them packs its saved tensors into host memory (the newest micro-batch,
whose backward comes last, waits longest), through torch's own mechanism, the saved-tensor hooks of
``torch.autograd.graph.save_on_cpu``. On a GPU the host copies are pinned and made on a dedicated
CUDA stream, and a micro-batch's copies start back to the device before its backward needs them
(:meth:`ActivationOffload.prefetch_next`, called when a backward ends for the nearest offloaded
micro-batch): so a stage holds ``keep`` micro-batches from their forwards, plus one on its way
back. On CPU processes the same hooks copy host to host, so the mechanism runs, and is tested,
everywhere; the values are copied exactly, so training equals training without it.

Parameters (and whatever the meter is told to ignore: weight versions) are never copied. Tensors
saved inside a recomputed (checkpointed) forward are the checkpoint's business: it saves nothing
but its inputs.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.runtime.activations.meter import SavedActivationMeter
from lightning_pipe.torch_internals import version


class _Packed:
    """One saved tensor in host memory, and its copy back on the device once fetched."""

    __slots__ = ("device", "fetched", "host", "meter", "nbytes", "owner")

    def __init__(
        self,
        owner: ActivationOffload,
        host: Tensor,
        device: torch.device,
        nbytes: int,
        meter: SavedActivationMeter | None,
    ) -> None:
        self.owner, self.host, self.device, self.nbytes, self.meter = owner, host, device, nbytes, meter
        self.fetched: Tensor | None = None
        owner.host_bytes += nbytes
        owner.peak_host_bytes = max(owner.peak_host_bytes, owner.host_bytes)

    def fetch(self, stream: torch.cuda.Stream | None) -> None:
        """Start (on ``stream``) or make the copy back to the device, once."""
        if self.fetched is not None:
            return
        if self.meter is not None:  # back on the device until autograd drops it
            self.meter.hold(self.nbytes)
        if stream is None:
            self.fetched = self.host.to(self.device, copy=True)  # host to host on a CPU process
            return
        with torch.cuda.stream(stream):
            self.fetched = self.host.to(self.device, non_blocking=True)

    def __del__(self) -> None:
        self.owner.host_bytes -= self.nbytes
        if self.meter is not None and self.fetched is not None:
            self.meter.hold(-self.nbytes)


class ActivationOffload:
    """One stage's offload: which micro-batches go to host memory, and their saved tensors there."""

    def __init__(self, keep: int) -> None:
        if keep < 0:
            raise ValueError(f"offload keeps {keep} micro-batches resident; give an integer >= 0.")
        self.keep = keep
        #: per offloaded micro-batch (forward done, backward not yet), its packed tensors
        self.held: dict[int, list[_Packed]] = {}
        #: bytes of saved tensors now in host memory, and their peak (the bytes that left the device)
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._ignored: set[int] = set()
        self._versions: set[int] = set()  # the weight versions held now (replaced as versions come and go)

    def chooses(self, resident: int) -> bool:
        """Whether the next forward goes to host memory, with ``resident`` micro-batches on the device."""
        return resident >= self.keep

    @contextmanager
    def hooks(self, microbatch: int, meter: SavedActivationMeter | None = None) -> Iterator[None]:
        """Around ``microbatch``'s forward: its saved tensors go to host memory; ``meter`` counts them
        again once they are back on the device for the backward (and sees the parameters as without offload)."""
        packed = self.held.setdefault(microbatch, [])
        ignored = self._ignored | self._versions | (meter.ignored() if meter is not None else set())
        # a tensor saved by several operations is copied once: the same tensor, still alive, unchanged
        seen: dict[tuple[Any, ...], tuple[weakref.ref[Tensor], _Packed]] = {}

        def pack(tensor: Tensor) -> object:
            if tensor.is_meta:  # a stand-in's shapes (the embeddings another stage holds): no data to copy
                return tensor
            if isinstance(tensor, nn.Parameter) or tensor.layout is not torch.strided or _storage(tensor) in ignored:
                return meter.pack(tensor) if meter is not None else tensor
            key = (tensor.data_ptr(), tensor.size(), tensor.stride(), tensor.dtype, version(tensor))
            earlier = seen.get(key)
            if earlier is not None and earlier[0]() is tensor:
                return earlier[1]
            item = self._pack(tensor, meter)
            seen[key] = (weakref.ref(tensor), item)
            packed.append(item)
            return item

        def unpack(saved: object) -> Tensor:
            if not isinstance(saved, _Packed):
                return SavedActivationMeter.unpack(saved)
            saved.fetch(None if saved.device.type != "cuda" else self._stream(saved.device))
            assert saved.fetched is not None
            if saved.device.type == "cuda":
                torch.cuda.current_stream(saved.device).wait_stream(self._stream(saved.device))
                saved.fetched.record_stream(torch.cuda.current_stream(saved.device))
            return saved.fetched

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def ignore(self, tensors: Iterable[Tensor]) -> None:
        """Never copy tensors sharing memory with ``tensors`` (the stage's parameters)."""
        self._ignored.update(_storage(t) for t in tensors)

    def ignore_versions(self, tensors: Iterable[Tensor]) -> None:
        """Never copy the weight versions held now, ``tensors``; those dropped since the last call are forgotten,
        so that the memory they leave, reused for an activation, is copied again."""
        self._versions = {_storage(t) for t in tensors}

    def _pack(self, tensor: Tensor, meter: SavedActivationMeter | None) -> _Packed:
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cuda":
            host = torch.empty(tensor.size(), dtype=tensor.dtype)
            host.copy_(tensor)
            return _Packed(self, host, tensor.device, nbytes, meter)
        stream = self._stream(tensor.device)
        host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # the device memory stays until the copy is done
        return _Packed(self, host, tensor.device, nbytes, meter)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def prefetch(self, microbatch: int) -> None:
        """Start copying ``microbatch``'s saved tensors back to the device (on a GPU, on the copy
        stream, overlapping the compute that runs meanwhile)."""
        for item in self.held.get(microbatch, ()):
            item.fetch(None if item.device.type != "cuda" else self._stream(item.device))

    def prefetch_next(self, after: int) -> None:
        """After ``after``'s backward: start bringing back the offloaded micro-batch nearest to it, whose
        backward is the next (a stage's backwards run in forward order, or in reverse under GPipe), so
        its copies overlap the work in between (on a GPU)."""
        if self.held:
            self.prefetch(min(self.held, key=lambda microbatch: (abs(microbatch - after), microbatch)))

    def offloaded(self, microbatch: int) -> bool:
        return microbatch in self.held

    def release(self, microbatch: int) -> None:
        """``microbatch``'s backward has run: forget its packed tensors (autograd freed its own holds)."""
        self.held.pop(microbatch, None)

    def reset(self) -> None:
        self.held.clear()


def _storage(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
