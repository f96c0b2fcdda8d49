"""Every stage of a pipeline must have loaded the same batch: shapes each step, values now and then.

Activation headers are sent once per *shape key* (see :mod:`lightning_pipe.runtime.p2p`), which
works only while every stage computes the same keys. A ``collate_fn`` whose padding length comes
from the process's random state gives the stages different shapes; the sender and the receivers
then disagree about whether a header comes, and the run hangs in a receive or gloo aborts on a
size mismatch. So each step, before its first receive, a rank compares a small fingerprint of its
micro-batch shapes with the other stages': one asynchronous all-gather of a few integers, posted
when the step begins and waited for only before the first receive, so no stage waits for a
slower one beyond what the schedule makes it wait anyway.

Equal shapes are not equal data: a Dataset whose ``__getitem__`` draws from the process's random
state gives stage 0 inputs of one sample and the last stage labels of another, and training runs
on silently. The stages' random states part as soon as one of them draws and another does not (a
``Dropout`` on the first stage only), so equal first batches prove nothing about the next ones.
So the same fingerprint also carries a checksum of a sample of the batch's values, every step by
default: it rides in the all-gather that the shapes need anyway, and sampling a few elements per
tensor keeps it cheap whatever the batch's size.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

_SLOTS = 32  # micro-batch count, key hash, content checksum, then the batch's first shapes for the message
_HEAD = 3
_SAMPLED = 64  # elements per tensor that enter the content checksum
NO_CONTENT = -1

#: where a step's batch came from, for the message: a name, or a function that gives it
Source = str | Callable[[], str]


def _shapes(keys: Sequence[Hashable]) -> list[tuple[int, ...]]:
    """The shapes in a micro-batch signature (``((shape, dtype), ...)``), or nothing if it is not one."""
    first = keys[0] if keys else ()
    if isinstance(first, tuple) and all(isinstance(k, tuple) and len(k) == 2 for k in first):
        return [tuple(shape) for shape, _ in first]
    return []


def checksum(tensors: Sequence[Tensor]) -> int:
    """A CRC of up to 64 evenly spaced elements of each tensor: equal for equal data, and cheap
    enough to run every step (a strided view and a 64-element copy per tensor, whatever the
    batch's size, and one read-back to the host for all of them: on a GPU the only wait is for
    the batch's own copy to the device)."""
    samples = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        if flat.numel() == 0:
            continue
        step = max(1, (flat.numel() - 1) // (_SAMPLED - 1))  # from the first element to (nearly) the last
        samples.append(flat[::step][:_SAMPLED].to(torch.float64))
    if not samples:
        return 0
    if len({s.device for s in samples}) > 1:
        samples = [s.cpu() for s in samples]
    return zlib.crc32(torch.cat(samples).cpu().numpy().tobytes())


def fingerprint(keys: Sequence[Hashable], content: Sequence[Tensor] | None = None) -> Tensor:
    """A fixed-size int64 summary of a step's micro-batch keys (and, given the batch's tensors, of
    a sample of their values), equal on two ranks exactly when their keys and sampled values are
    (up to CRC collisions). Stable across processes: Python's ``hash`` of strings is salted per process."""
    values = [len(keys), zlib.crc32(repr(list(keys)).encode()), NO_CONTENT if content is None else checksum(content)]
    for shape in _shapes(keys):
        if len(values) + 1 + len(shape) > _SLOTS:
            break
        values += [len(shape), *shape]
    return torch.tensor(values + [-1] * (_SLOTS - len(values)), dtype=torch.int64)


def describe(row: Sequence[int]) -> str:
    """The first micro-batch's shapes and the micro-batch count from a fingerprint."""
    count, _, _, *rest = row
    shapes, pos = [], 0
    while pos < len(rest) and rest[pos] >= 0:
        ndim = rest[pos]
        shapes.append(tuple(rest[pos + 1 : pos + 1 + ndim]))
        pos += 1 + ndim
    return f"{count} micro-batches, the first with tensor shapes {shapes}"


def mismatch_message(rows: Sequence[Sequence[int]], source: str = "the DataLoader") -> str | None:
    """None when every stage's fingerprint is the same; otherwise what each stage loaded, why it
    matters and how to fix it. ``source`` names the DataLoader the batch came from."""
    if all(list(row) == list(rows[0]) for row in rows):
        return None
    if all(list(row[:2]) == list(rows[0][:2]) for row in rows):  # same shapes, different values
        return (
            f"The pipeline's stages loaded different data for the same step from {source}: the batches have the "
            f"same shapes ({describe(rows[0])}) but different values (checksums "
            + ", ".join(f"stage {s}: {row[2]}" for s, row in enumerate(rows))
            + "). Every stage loads each batch itself, so each sample must be the same in every process: the "
            "Dataset's __getitem__ (or the collate_fn) draws from the process's own random state (torch.randn, "
            "torch.randint, random, numpy without a generator), which differs between stages (their random states "
            "part as soon as one stage draws and another does not, as a Dropout on one stage does). Derive the "
            "randomness from the sample, e.g. `g = torch.Generator().manual_seed(index)` and "
            "`torch.randn(..., generator=g)`, as the BERT recipe's masking does. (This is checked every step; "
            "PipelineStrategy(check_data=N) checks every N steps, check_data=False never.)"
        )
    seen = "; ".join(f"stage {s}: {describe(row)}" for s, row in enumerate(rows))
    return (
        "The pipeline's stages loaded batches of different shapes for the same step (" + seen + "). Every stage "
        "loads each batch itself, so the data pipeline must give every process the same batch: shapes, padding and "
        "any randomness that changes them must not come from the process's own random state (Python's `random`, "
        "`torch.rand` without a generator in a collate_fn or Dataset). Derive them from the sample (for example "
        "a torch.Generator seeded from the index), or pad to a fixed length."
    )


class BatchAgreement:
    """Posts a step's fingerprint to the other stages of the pipeline and checks the answer."""

    def __init__(self, group: ProcessGroup, num_stages: int) -> None:
        self.group = group
        self.num_stages = num_stages
        self._pending: tuple[Any, list[Tensor], Source] | None = None

    def post(
        self, keys: Sequence[Hashable], content: Sequence[Tensor] | None = None, source: Source = "the DataLoader"
    ) -> None:
        """Start comparing this step's keys, and the sampled values of ``content`` when given (checks
        the previous step's comparison first if still open). ``source`` names where the batch came
        from, or gives that name when called: it is formatted only if the stages disagree."""
        self.check()
        mine = fingerprint(keys, content)
        rows = [torch.empty_like(mine) for _ in range(self.num_stages)]
        work = dist.all_gather(rows, mine, group=self.group, async_op=True)
        self._pending = (work, rows, source)

    def check(self) -> None:
        """Wait for the posted comparison; raise if the stages disagree. A no-op when none is open."""
        if self._pending is None:
            return
        (work, rows, source), self._pending = self._pending, None
        work.wait()
        seen = [row.tolist() for row in rows]
        if any(row != seen[0] for row in seen):
            raise RuntimeError(mismatch_message(seen, source() if callable(source) else source))
