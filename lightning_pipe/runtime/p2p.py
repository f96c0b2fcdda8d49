"""Shape-aware point-to-point transport between neighbouring stages, and between the two stages of
a skip connection (:mod:`lightning_pipe.runtime.crossing.skips`: the one that stashes, the one that pops).

Activations travel with a small header (dtypes, shapes, which tensors need a gradient, whether
the stage returned a tuple, and how many recorded values of each earlier block travel after the
hidden state: :mod:`lightning_pipe.runtime.crossing.carried`) so a receiver can allocate buffers for shapes
it has never seen. The header goes as its length, then its integers, so it has no fixed size: a
64-layer MoE's router logits (one tensor per block) need no cap. A
header goes once per *shape key* (the stage and the micro-batch's input shapes), which every rank
computes alike because every rank sees the same batch: steady-state steps send payloads only, while
a short last batch or a new sequence length sends a fresh header. Headers use a gloo group, so on
GPUs reading them never waits on a CUDA stream. Gradients need no header: a stage knows the shapes
of the outputs it sent.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_pipe.runtime.crossing.wire import SINGLE, Op, Packing, TensorMeta


class Transport:
    """Sends and receives between the ranks that hold neighbouring stages."""

    def __init__(
        self,
        stage_ranks: Sequence[int],
        device: torch.device,
        group: ProcessGroup | None = None,
        meta_group: ProcessGroup | None = None,
        batched: bool = False,
        through_host: bool = False,
    ) -> None:
        self.stage_ranks = list(stage_ranks)
        # gloo cannot send GPU tensors: stage them through (pinned) host memory
        self.through_host = through_host
        self._pin = through_host and device.type == "cuda"
        self._on_gpu = device.type == "cuda"
        # skip connections go on the gloo group under NCCL (see post_skips): through host memory on a GPU
        self._skips_staged = self._on_gpu and (through_host or batched)
        self.device = device
        self.group = group
        self.meta_group = meta_group
        self.batched = batched  # group each post into one batch_isend_irecv (NCCL)
        # gloo matches each (peer, tag) stream in posting order whatever else is posted, so a
        # receive may be posted early; NCCL runs a rank's P2P in posting order: it may not
        self.prefetches_receives = not batched
        self._sent: dict[Hashable, TensorMeta] = {}
        self._received: dict[Hashable, TensorMeta] = {}
        self._header_works: list[Any] = []
        n = len(self.stage_ranks)
        self._streams = 2 * n + 4 * n * n  # activations and gradients per stage, then per pair of stages skips'
        self._window = max(1, (2**31 - 1) // self._streams)  # micro-batch numbers that a tag tells apart

    def tag(self, stream: int, microbatch: int) -> int:
        """The tag of ``stream``'s message of ``microbatch``: each (stream, micro-batch) its own, so
        messages pair by the micro-batch their actions name, not by the order they were posted in.
        Micro-batch numbers more than ``2**31 / streams`` apart share a tag (the asynchronous
        schedules' global numbers grow without end; those in flight at once are never that far apart)."""
        return stream + self._streams * (microbatch % self._window)

    def activation_send_ops(
        self,
        to_stage: int,
        key: Hashable,
        tensors: Sequence[Tensor],
        packing: Packing = SINGLE,
        microbatch: int = 0,
        alike: int | None = None,
    ) -> list[Op]:
        """Ops that send ``tensors`` (detached) of ``microbatch`` to ``to_stage``; the header, if this key
        is new, goes now (its length, then its integers), tagged with ``alike``: the first micro-batch of
        the step with the same shapes (``microbatch`` where None), which the receiver names alike whichever
        of those micro-batches it receives first."""
        peer = self.stage_ranks[to_stage]
        header_tag = self.tag(2 * to_stage, microbatch if alike is None else alike)
        self._send_header(to_stage - 1, peer, key, TensorMeta.of(tensors, packing), header_tag)
        tag = self.tag(2 * to_stage, microbatch)
        return [Op(True, self._outgoing(t), peer, tag) for t in tensors]

    def _send_header(self, stage: int, peer: int, key: Hashable, meta: TensorMeta, tag: int) -> None:
        """Send ``meta`` (its length, then its integers) where ``key`` is new; refuse new shapes for a known key."""
        known = self._sent.get(key)
        if known is None:
            self._sent[key] = meta
            header = meta.encode()
            length = torch.tensor([header.numel()], dtype=torch.int64)
            for part in (length, header):
                self._header_works.append((dist.isend(part, peer, group=self.meta_group, tag=tag), part))
        elif known != meta:
            raise RuntimeError(
                f"Stage {stage} produced outputs of shapes {list(meta.shapes)} for a micro-batch whose input "
                f"shapes gave {list(known.shapes)} before. The pipeline caches activation shapes by input shapes; "
                "stage outputs must depend only on the shapes of the batch, not on its values."
            )

    def _read_header(self, peer: int, key: Hashable, tag: int) -> TensorMeta:
        """The header of ``key``: known, or read now (waiting until the sender gets there)."""
        meta = self._received.get(key)
        if meta is None:
            length = torch.empty(1, dtype=torch.int64)
            dist.recv(length, peer, group=self.meta_group, tag=tag)
            header = torch.empty(int(length.item()), dtype=torch.int64)
            dist.recv(header, peer, group=self.meta_group, tag=tag)
            meta = self._received[key] = TensorMeta.decode(header)
        return meta

    def knows(self, key: Hashable) -> bool:
        """Whether the shapes of activations received under ``key`` are known (no header to wait for)."""
        return key in self._received

    def activation_recv_ops(
        self, from_stage: int, key: Hashable, microbatch: int = 0, alike: int | None = None
    ) -> tuple[list[Tensor], TensorMeta, list[Op]]:
        """Buffers and ops that receive ``microbatch``'s activation; reads the header first if this key
        is new (tagged with ``alike``, as :meth:`activation_send_ops` sends it)."""
        peer = self.stage_ranks[from_stage]
        stream = 2 * (from_stage + 1)
        meta = self._read_header(peer, key, self.tag(stream, microbatch if alike is None else alike))
        device = "cpu" if self.through_host else self.device
        buffers = [
            torch.empty(s, dtype=d, device=device, pin_memory=self._pin) for s, d in zip(meta.shapes, meta.dtypes)
        ]
        tag = self.tag(stream, microbatch)
        return buffers, meta, [Op(False, b, peer, tag) for b in buffers]

    def gradient_send_ops(self, to_stage: int, grads: Sequence[Tensor], microbatch: int = 0) -> list[Op]:
        """Ops that send the gradients of ``to_stage``'s output of ``microbatch`` back to it."""
        peer, tag = self.stage_ranks[to_stage], self.tag(2 * to_stage + 1, microbatch)
        return [Op(True, self._outgoing(g), peer, tag) for g in grads]

    def gradient_recv_ops(
        self, from_stage: int, like: Sequence[Tensor], microbatch: int = 0
    ) -> tuple[list[Tensor], list[Op]]:
        """Buffers and ops that receive the gradients of this stage's output of ``microbatch`` (shaped ``like``)."""
        peer, tag = self.stage_ranks[from_stage], self.tag(2 * (from_stage - 1) + 1, microbatch)
        device = "cpu" if self.through_host else self.device
        buffers = [torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=self._pin) for t in like]
        return buffers, [Op(False, b, peer, tag) for b in buffers]

    # ---- skip connections (lightning_pipe.skips): from the stage that stashes straight to the one that pops
    def _skip_tag(self, source: int, target: int, kind: int) -> int:
        """The stream of one pair's skip connections (``kind`` 0), their gradients (1) or their headers (2),
        apart from every other stream (the activations' and gradients' tags are below ``2 x stages``)."""
        n = len(self.stage_ranks)
        return 2 * n + 4 * (source * n + target) + kind

    def skip_send_ops(
        self,
        source: int,
        target: int,
        key: Hashable,
        tensors: Sequence[Tensor],
        microbatch: int = 0,
        alike: int | None = None,
    ) -> list[Op]:
        """Ops that send stage ``source``'s stashed ``tensors`` of ``microbatch`` to stage ``target``, which
        pops them; with a header (on its own stream, tagged with ``alike`` as activations' are) where
        ``key`` is new."""
        peer, tag = self.stage_ranks[target], self.tag(self._skip_tag(source, target, 0), microbatch)
        header_tag = self.tag(self._skip_tag(source, target, 2), microbatch if alike is None else alike)
        self._send_header(source, peer, key, TensorMeta.of(tensors), header_tag)
        return [Op(True, self._outgoing(t, self._skips_staged), peer, tag) for t in tensors]

    def skip_recv_ops(
        self, source: int, target: int, key: Hashable, microbatch: int = 0, alike: int | None = None
    ) -> tuple[list[Tensor], TensorMeta, list[Op]]:
        """Buffers and ops that receive on stage ``target`` what stage ``source`` stashed for it of ``microbatch``."""
        peer, tag = self.stage_ranks[source], self.tag(self._skip_tag(source, target, 0), microbatch)
        header_tag = self.tag(self._skip_tag(source, target, 2), microbatch if alike is None else alike)
        meta = self._read_header(peer, key, header_tag)
        buffers = [self._buffer(s, d, self._skips_staged) for s, d in zip(meta.shapes, meta.dtypes)]
        return buffers, meta, [Op(False, b, peer, tag) for b in buffers]

    def skip_grad_send_ops(self, target: int, source: int, grads: Sequence[Tensor], microbatch: int = 0) -> list[Op]:
        """Ops that send the gradients of what stage ``source`` stashed back to it from stage ``target``."""
        peer, tag = self.stage_ranks[source], self.tag(self._skip_tag(source, target, 1), microbatch)
        return [Op(True, self._outgoing(g, self._skips_staged), peer, tag) for g in grads]

    def skip_grad_recv_ops(
        self, target: int, source: int, like: Sequence[Tensor], microbatch: int = 0
    ) -> tuple[list[Tensor], list[Op]]:
        """Buffers and ops that receive on stage ``source`` the gradients of ``like`` (what it stashed)."""
        peer, tag = self.stage_ranks[target], self.tag(self._skip_tag(source, target, 1), microbatch)
        buffers = [self._buffer(t.shape, t.dtype, self._skips_staged) for t in like]
        return buffers, [Op(False, b, peer, tag) for b in buffers]

    def post_skips(self, ops: Sequence[Op]) -> list[Any]:
        """Post skip connections' ops, one by one and never batched: under NCCL they go through host
        memory on the gloo group, so that they never enter the order in which NCCL matches a rank's
        point-to-point calls (the schedule's own, regrouped to rendezvous)."""
        group = self.meta_group if self.batched else self.group
        return [(dist.isend if op.is_send else dist.irecv)(op.tensor, op.peer, group=group, tag=op.tag) for op in ops]

    def skips_arrived(self, buffers: list[Tensor]) -> list[Tensor]:
        """Received skip connections (or their gradients) on this rank's device."""
        return self.arrived(buffers, self._skips_staged)

    def _buffer(self, shape: Sequence[int], dtype: torch.dtype, staged: bool) -> Tensor:
        device = "cpu" if staged else self.device
        return torch.empty(tuple(shape), dtype=dtype, device=device, pin_memory=staged and self._on_gpu)

    def _outgoing(self, tensor: Tensor, staged: bool | None = None) -> Tensor:
        if self.through_host if staged is None else staged:
            return tensor.detach().to("cpu", copy=True).contiguous()
        return tensor.detach().contiguous()

    def arrived(self, buffers: list[Tensor], staged: bool | None = None) -> list[Tensor]:
        """Received tensors on this rank's device (a copy from the host buffers when staging)."""
        if not (self.through_host if staged is None else staged):
            return buffers
        pinned = self._on_gpu
        return [b.to(self.device, non_blocking=pinned, copy=True) for b in buffers]

    def post(self, ops: Sequence[Op]) -> list[Any]:
        """Post ``ops`` without blocking; returns the works to wait on."""
        if not ops:
            return []
        if self.batched:
            p2p = [
                dist.P2POp(dist.isend if op.is_send else dist.irecv, op.tensor, op.peer, self.group, op.tag)
                for op in ops
            ]
            return list(dist.batch_isend_irecv(p2p))
        works = []
        for op in ops:
            fn = dist.isend if op.is_send else dist.irecv
            works.append(fn(op.tensor, op.peer, group=self.group, tag=op.tag))
        return works

    def finish(self) -> None:
        """Wait for the headers sent this step."""
        for work, _ in self._header_works:
            work.wait()
        self._header_works.clear()
