"""What goes on the wire between stages, as values (a leaf module: the transport and the crossings share
it): a message's :class:`Packing`, the header (:class:`TensorMeta`) a receiver allocates from, and one send or
receive to post (:class:`Op`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Packing:
    """How one message's flat tensors make a stage's value again: ``was_tuple`` (the hidden state was a
    tuple), and ``recorded``, per earlier block the counts of the recorded values after the hidden state."""

    was_tuple: bool = False
    recorded: tuple[int, ...] = ()


#: a single tensor with nothing recorded after it (a gradient's message, a plain stage's output)
SINGLE = Packing()


_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to allocate an activation."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    requires_grad: tuple[bool, ...]
    #: whether the hidden state was a tuple, and per earlier block how many of its recorded values travel
    #: after it (none: empty)
    packing: Packing = SINGLE

    @classmethod
    def of(cls, tensors: Sequence[Tensor], packing: Packing = SINGLE) -> TensorMeta:
        return cls(
            tuple(tuple(t.shape) for t in tensors),
            tuple(t.dtype for t in tensors),
            tuple(bool(t.requires_grad) for t in tensors),
            packing,
        )

    def encode(self) -> Tensor:
        """The header's integers (any number: :meth:`Transport.activation_send_ops` sends its length first)."""
        recorded = self.packing.recorded
        values = [int(self.packing.was_tuple), len(self.shapes), len(recorded), *recorded]
        for shape, dtype, grad in zip(self.shapes, self.dtypes, self.requires_grad):
            if dtype not in _DTYPES:
                raise TypeError(f"A pipeline stage output has dtype {dtype}, which cannot be sent between stages.")
            values += [_DTYPES.index(dtype), int(grad), len(shape), *shape]
        return torch.tensor(values, dtype=torch.int64)

    @classmethod
    def decode(cls, header: Tensor) -> TensorMeta:
        values = header.tolist()
        was_tuple, count, blocks = bool(values[0]), values[1], values[2]
        recorded, pos = tuple(values[3 : 3 + blocks]), 3 + blocks
        shapes, dtypes, grads = [], [], []
        for _ in range(count):
            dtype, grad, ndim = values[pos : pos + 3]
            shapes.append(tuple(values[pos + 3 : pos + 3 + ndim]))
            dtypes.append(_DTYPES[dtype])
            grads.append(bool(grad))
            pos += 3 + ndim
        return cls(tuple(shapes), tuple(dtypes), tuple(grads), Packing(was_tuple, recorded))


@dataclass
class Op:
    """One send or receive to post: ``tensor`` goes to or comes from global rank ``peer``. ``tag``
    names the stream (activations into stage s: 2s, gradients into stage s: 2s + 1, then the skip
    connections') and the micro-batch (:meth:`Transport.tag`), so that a message meets the receive
    of the micro-batch it carries whatever order either rank runs its micro-batches in (gloo matches
    per peer and tag), and receives may be posted early."""

    is_send: bool
    tensor: Tensor
    peer: int
    tag: int = 0
