"""Each data-parallel replica of the pipeline reads its own part of every step, and a resumed run
reads on where the checkpoint left off.

Training: a DataLoader the pipeline steers (:func:`not_steered` says which: a map-style dataset, the
default batch sampler, a sequential sampler or a shuffling ``RandomSampler``) gets a
:class:`ReplicaOrder` in place of its sampler, with any number of replicas, one included. The
epoch's global order is the dataset's indices, permuted from the run's seed (``seed_everything``'s)
and the epoch when the user's sampler shuffled (``DistributedSampler``'s permutation: it does not
depend on the number of replicas); replica ``r`` of ``d`` reads positions ``r, r + d, ...``, so that
global step ``s`` reads positions ``[s B d, (s + 1) B d)`` for the DataLoader's batch ``B``. All
stages of one replica compute the same order, without any process's random state, so the
pipeline's shared sample order (:mod:`lightning_pipe.trainer.dataloaders.sampling`) leaves it alone. A
checkpoint keeps the epoch, its seed and the global samples read (:meth:`ReplicaOrder.position`);
the resumed run reads the rest of that epoch from there (:meth:`ReplicaOrder.resume`), under any
number of replicas, and every later epoch as an uninterrupted run would.

Evaluation (validation, test): a ``DistributedSampler`` would pad the replicas' parts to equal
sizes with repeated samples, which then count twice in the metrics. :class:`EvaluationShare`
splits the samples without repeating any; a replica that runs out of samples before the others
gets one-sample padding batches, so that the replicas still step together (their step summaries
are combined every step), and skips them (:func:`is_padding`). Replica ``j``'s ``k``-th batch holds
the samples ``j, j + d, ...`` of plain training's ``k``-th batch of ``d`` times the batch size, so
the replicas' batches of a step together are that global batch. :func:`combine_over_replicas` then
weights each replica's means by what they average over (its real sample count, or with
``loss_weight`` what that counts, such as tokens) and logs the step's global sample count as
``batch_size``, which is what Lightning weights the epoch means by: every step's mean is the global
batch's (its token mean under ``token_count``) and every sample counts once, as in plain training
on one process with batches of ``d`` times the batch size.

Samplers other than the plain sequential and random ones are kept as given: every replica then
reads them whole (each pipeline keeps its own shared order), the replicas do not split the data,
and a resume in the middle of an epoch starts that epoch again (Lightning's behaviour).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from lightning_pipe.trainer.reductions import reduction


def not_steered(dataloader: DataLoader) -> str | None:
    """Why the pipeline does not choose ``dataloader``'s order (for the user), or None where it does: a
    map-style dataset, the default batch sampler, and a ``SequentialSampler`` or a ``RandomSampler``
    that draws a permutation (``shuffle=True``; a subclass that keeps ``RandomSampler``'s iteration)."""
    if isinstance(dataloader.dataset, IterableDataset):
        return "an IterableDataset"
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return f"a custom batch_sampler ({type(batch_sampler).__name__})"
    sampler = dataloader.sampler
    if isinstance(sampler, SequentialSampler) and type(sampler).__iter__ is SequentialSampler.__iter__:
        return None
    if (
        isinstance(sampler, RandomSampler)
        and type(sampler).__iter__ is RandomSampler.__iter__
        and not sampler.replacement
        and sampler.num_samples == len(sampler.data_source)
    ):
        return None
    return f"a custom sampler ({type(sampler).__name__})"


def splittable(dataloader: DataLoader, num_replicas: int) -> bool:
    """Whether the replicas split ``dataloader`` (not: one replica, or one the pipeline does not steer)."""
    return num_replicas > 1 and not_steered(dataloader) is None


class ReplicaOrder(DistributedSampler):
    """Replica ``rank``'s part of each epoch's global order (see the module's doc), resumable.

    ``replaced``: the user's sampler, which still gets ``set_epoch`` (a sampler that passes the epoch
    on to its dataset, for augmentations drawn per sample and epoch, keeps doing so). Its length is
    that of a whole epoch, as Lightning counts an epoch's batches; a resumed epoch yields only the
    rest, from the saved position, whose batches Lightning counts as done."""

    def __init__(self, dataset: Any, num_replicas: int, rank: int, shuffle: bool, seed: int, replaced: Any = None):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.replaced = replaced
        self._resume: tuple[int, int, int] | None = None  # epoch, its seed, global samples already read
        self._drawn: tuple[int, int] = (-1, seed)  # the epoch last iterated and the seed of its order
        self._grouping: tuple[int, int, int] | None = None  # see regroup

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        forward = getattr(self.replaced, "set_epoch", None)
        if callable(forward):
            forward(epoch)

    def order(self, epoch: int, seed: int) -> list[int]:
        """The global order of ``epoch``: the same permutation as ``DistributedSampler``'s, for any replicas."""
        if not self.shuffle:
            return list(range(len(self.dataset)))  # type: ignore[arg-type]  # a map-style dataset has a length
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        seed, start = self.seed, 0
        if self._resume is not None and self._resume[0] == self.epoch:
            _, seed, start = self._resume
        self._resume = None  # a position holds for the epoch it was saved in only
        self._drawn = (self.epoch, seed)
        order = self.order(self.epoch, seed)
        rest = order[start:]
        regrouped, rest = self._regrouped(rest, start)
        padding = -len(rest) % self.num_replicas  # as DistributedSampler pads: from the epoch's first samples
        rest += (order * math.ceil(padding / max(len(order), 1)))[:padding]
        return iter(regrouped + rest[self.rank :: self.num_replicas])

    def regroup(self, replicas: int, accumulate: int, batch: int) -> None:
        """Read every update as ``replicas`` replicas read it (the first start of an elastic run, which
        this start, accumulating ``accumulate`` batches of ``batch``, continues with the same global batch).

        The replicas' gradients, like the accumulated batches', are averaged with equal weights, each the
        gradient of its own batch's mean: with a ``loss_weight`` (token means) the update depends on which
        samples share a batch, not only on the global batch. Replica ``r`` of ``d`` here reads, as its
        ``k``-th batch of an update, the batch that the first start's batch number ``k d + r`` of that
        update was (its replicas' batches, replica-major within each of its accumulated batches)."""
        self._grouping = (replicas, accumulate, batch)

    def _regrouped(self, rest: list[int], start: int) -> tuple[list[int], list[int]]:
        """This replica's samples of ``rest`` as :meth:`regroup` groups them, and the samples left to read
        as usual: all of them without a regrouping or where it does not apply (an epoch resumed within an
        update, a first start whose batches do not fill this start's updates), and an epoch's last part
        update where its batches would not be the first start's (padded, or not filling the batches)."""
        if self._grouping is None:
            return [], rest
        first, accumulate, batch = self._grouping
        replicas = self.num_replicas
        update = replicas * accumulate * batch
        if first == replicas or update % (first * batch) or start % update:
            return [], rest
        whole = len(rest) - len(rest) % update
        mine = self._read_as_first(rest[:whole], self.rank) or []  # whole updates always line up
        tail = rest[whole:]
        if not tail or len(tail) % first:  # the first start padded its last batches: read as usual
            return mine, tail
        parts = [self._read_as_first(tail, replica) for replica in range(replicas)]
        if any(part is None or len(part) != len(tail) // replicas for part in parts):
            return mine, tail
        return mine + (parts[self.rank] or []), []

    def _read_as_first(self, samples: list[int], replica: int) -> list[int] | None:
        """``replica``'s batches of ``samples`` (whole updates, or an epoch's last part of one) where each is
        the first start's batch it stands for; None where a part update's batches do not line up."""
        first, accumulate, batch = self._grouping or (1, 1, 1)
        update = self.num_replicas * accumulate * batch
        read: list[int] = []
        for base in range(0, len(samples), update):
            sizes = []
            for k in range(accumulate):
                block, of = divmod(k * self.num_replicas + replica, first)
                begin = base + block * first * batch + of
                group = (
                    samples[begin : min(begin + first * batch, len(samples)) : first] if begin < len(samples) else []
                )
                sizes.append(len(group))
                read += group
            filled = [n for n in sizes if n]
            if any(n != batch for n in filled[:-1]):  # a short batch before another would merge with it
                return None
        return read

    def position(self, samples: int, complete: bool = False) -> dict[str, Any]:
        """What a checkpoint keeps: the epoch's order (its seed: a resumed epoch keeps the saved one), the
        global samples read in it, and whether it is ``complete`` (a ``drop_last`` epoch reads fewer)."""
        seed = self._drawn[1] if self._drawn[0] == self.epoch else self.seed
        size = len(self.dataset)  # type: ignore[arg-type]  # a map-style dataset has a length
        return {"epoch": self.epoch, "seed": seed, "shuffle": self.shuffle, "size": size, "samples": samples,
                "complete": complete}  # fmt: skip

    def resume(self, state: dict[str, Any]) -> str | None:
        """Read on from a saved :meth:`position` in its epoch; what is not exact (for a warning), or None."""
        size = len(self.dataset)  # type: ignore[arg-type]
        if (state.get("size"), state.get("shuffle")) != (size, self.shuffle):
            return (
                f"the checkpoint's training data had {state.get('size')} samples, shuffle={state.get('shuffle')}, and "
                f"this run's has {size}, shuffle={self.shuffle}: the saved epoch starts again from its first sample"
            )
        epoch, samples = int(state["epoch"]), min(int(state["samples"]), size)
        # the epoch a DataLoader with workers starts drawing from before Lightning's set_epoch: the saved
        # one, or the next where the save ended its epoch
        self.set_epoch(epoch + 1 if state.get("complete") or samples >= size else epoch)
        self._resume = (epoch, int(state["seed"]), samples)
        return None


class EvaluationShare(BatchSampler):
    """Replica ``replica``'s batches of an evaluation DataLoader over ``num_samples`` samples: the
    samples ``replica, replica + d, ...`` (none repeated; with ``drop_last``, only the samples that
    plain training's full batches hold), in batches of ``batch_size``, followed by one-sample
    padding batches up to the number of batches of the replica with the most, so that every
    replica runs the same number of steps. Iterating it draws nothing at random (the stages of a
    replica read the same batches)."""

    def __init__(self, num_samples: int, batch_size: int, drop_last: bool, num_replicas: int, replica: int) -> None:
        kept = num_samples - num_samples % batch_size if drop_last else num_samples
        indices = list(range(replica, kept, num_replicas))
        super().__init__(indices, batch_size, drop_last=False)
        #: this replica's batches that hold samples; the ones after them are padding
        self.real_batches = math.ceil(len(indices) / batch_size)
        self.steps = math.ceil(math.ceil(kept / num_replicas) / batch_size)
        self._padding = [indices[0] if indices else 0]

    def __iter__(self) -> Any:
        yield from super().__iter__()
        for _ in range(self.steps - self.real_batches):
            yield list(self._padding)

    def __len__(self) -> int:
        return self.steps

    def is_padding(self, batch_idx: int) -> bool:
        """Whether batch ``batch_idx`` only keeps this replica in step with the others."""
        return batch_idx >= self.real_batches


def _contribute(
    summary: dict[str, Any], how: list[str], weight: float, has_loss: bool, flat: Tensor, extremes: Tensor
) -> None:
    """This replica's part of the sums (``flat``: the loss and each logged value with its weight; a
    replica with samples but nothing counted, weight 0, adds no mean) and of the ``extremes``."""
    if weight > 0:
        flat[0], flat[1] = (summary["loss"] if has_loss else 0.0) * weight, weight
    for i, (_, value, kwargs) in enumerate(summary["logs"]):
        if how[i] in ("max", "min"):
            extremes[i] = value if how[i] == "max" else -value
        elif how[i] == "sum":
            flat[2 + 2 * i], flat[3 + 2 * i] = value, 1.0
        else:
            logged = float(kwargs.get("batch_size", weight))
            if logged > 0:
                flat[2 + 2 * i], flat[3 + 2 * i] = value * logged, logged


#: A step summary with nothing in it: a replica's padding step
EMPTY: dict[str, Any] = {"loss": None, "logs": []}


def combine_over_replicas(
    summary: dict[str, Any], group: ProcessGroup, device: torch.device, samples: int | None = None
) -> dict[str, Any]:
    """The step summary's loss and logged values over the replicas in ``group`` (every replica's
    last stage, which computed them): means as below, values logged with ``reduce_fx`` ``"max"``,
    ``"min"`` or ``"sum"`` by the largest, the smallest or the sum of the replicas' values.

    In evaluation (``samples``: the replica's real sample count, 0 on a padding step, whose replica
    takes the other replicas' names) each mean is weighted by the ``batch_size`` it was logged with
    where the step gave one, else by the summary's ``items`` (what the replica's means average over:
    its samples, or what ``loss_weight`` counts, such as tokens), so that the step's mean is the global
    batch's; each value is logged with the step's global sample count as ``batch_size``, so that
    Lightning's epoch means weight the steps as plain training weights its batches. ``samples=None``
    (training, where every replica's batch has the same size) weights the replicas equally, as DDP
    averages their gradients."""
    # training: the replicas' batches weigh the same; evaluation: what the replica's means average over
    # (nothing on a padding step)
    weight = 1.0 if samples is None else float(summary.get("items", samples)) if samples else 0.0
    has_loss = summary["loss"] is not None
    header = torch.tensor(
        [float(len(summary["logs"])), float(has_loss), float(samples or 0)], dtype=torch.float64, device=device
    )
    headers = [torch.empty_like(header) for _ in range(dist.get_world_size(group))]
    dist.all_gather(headers, header, group=group)
    rows = [h.tolist() for h in headers]
    with_data = [i for i, row in enumerate(rows) if samples is None or row[2] > 0]
    shapes = {(int(rows[i][0]), bool(rows[i][1])) for i in with_data}
    if len(shapes) > 1:
        raise RuntimeError(
            "The data-parallel replicas logged different values in one step (counts "
            f"{[int(row[0]) for row in rows]}). Under data parallelism every replica must log the same names "
            "in each step."
        )
    structure = [(name, kwargs) for name, _, kwargs in summary["logs"]]
    if 0 < len(with_data) < len(rows):  # a replica without samples in this step takes the others' names
        box = [(structure, has_loss)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, with_data[0]), group=group)
        structure, has_loss = box[0]
    how = [reduction(kwargs.get("reduce_fx", "mean")) for _, kwargs in structure]
    flat = torch.zeros(2 + 2 * len(structure), dtype=torch.float64, device=device)
    # max and min go through one MAX all-reduce (a min as the max of the negated values); a
    # replica without samples adds -inf there and nothing to the sums
    extremes = torch.full((len(structure),), -math.inf, dtype=torch.float64, device=device)
    if samples is None or samples > 0:
        _contribute(summary, how, weight, has_loss, flat, extremes)
    dist.all_reduce(flat, group=group)
    if any(h in ("max", "min") for h in how):
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    sums, largest = flat.tolist(), extremes.tolist()
    total = sum(row[2] for row in rows)

    def mean(i: int) -> float:
        return sums[2 * i] / sums[2 * i + 1] if sums[2 * i + 1] else float("nan")

    def reduced(i: int) -> float:  # the i-th logged value over the replicas, reduced as it was logged
        reduce = how[i - 1]
        if reduce in ("max", "min"):
            return largest[i - 1] if reduce == "max" else -largest[i - 1]
        return sums[2 * i] if reduce == "sum" else mean(i)

    logs = []
    for i, (name, kwargs) in enumerate(structure, start=1):
        kwargs = dict(kwargs)
        if "batch_size" in kwargs:
            kwargs["batch_size"] = round(sums[2 * i + 1])
        elif samples is not None:
            kwargs["batch_size"] = int(total)
        logs.append((name, reduced(i), kwargs))
    return {**summary, "loss": mean(0) if has_loss else None, "logs": logs, "items": sums[1]}
