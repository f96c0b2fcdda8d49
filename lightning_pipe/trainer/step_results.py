"""What a step returns and logs, once per batch although it runs once per micro-batch.

On the last stage the user's step runs for each micro-batch. Its ``self.log`` calls are recorded
instead of reaching Lightning; after the batch, each value is reduced over the micro-batches as
its ``reduce_fx`` says (``"mean"``: weighted by each micro-batch's share of the batch, so it
equals the whole batch's mean; by the ``batch_size`` given to ``self.log`` where every
micro-batch gave one, as Lightning weights epoch means by it; ``"max"``/``"min"``: the largest /
smallest of the micro-batches' values; ``"sum"``: their sum), sent to every rank and logged there
once with the same ``reduce_fx``, so ``trainer.callback_metrics`` agree everywhere and equal
plain Lightning's.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from numbers import Number
from typing import Any, cast

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_pipe.runtime.blocks.reads import refuse_held
from lightning_pipe.trainer import internals
from lightning_pipe.trainer.reductions import combine, reduction

#: Lightning's advice for values logged per epoch, moot under the pipeline: every rank already logs the last
#: stage's values, averaged over the replicas, and Lightning drops ``sync_dist`` for a strategy that is not
#: ``is_distributed`` (the pipeline's is not, so that Lightning never swaps in its own sampler)
SYNC_DIST_ADVICE = r"It is recommended to use `self\.log\(.*sync_dist=True\)` when logging on epoch level"
#: torch 2.13's deprecation of ``LeafSpec``, which Lightning's own ``CombinedLoader`` (around every DataLoader
#: of a fit) triggers once in every process: Lightning's to change, nothing a user can act on
LEAF_SPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def quiet_moot_warnings() -> None:
    """Leave out, in this process, the two warnings above: one that does not apply under the pipeline and
    one that Lightning's own code raises on every rank."""
    warnings.filterwarnings("ignore", message=SYNC_DIST_ADVICE)
    warnings.filterwarnings("ignore", message=LEAF_SPEC, category=FutureWarning, module=r"lightning\.pytorch\.")


_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_LOG_OPTIONS = frozenset(_LOG_SIGNATURE.parameters) - {"self", "name", "value"}


@dataclass
class _Logged:
    weighted_sum: float | Tensor = 0.0  # a tensor stays on its device until the step's end
    weight: float = 0.0
    batch_size: int | None = None  # the sum of the batch sizes given to self.log
    sized_sum: float | Tensor = 0.0  # values times the batch sizes given to self.log
    calls: int = 0
    sized_calls: int = 0
    kwargs: dict[str, Any] = field(default_factory=dict)
    reduce: str = "mean"  # Lightning's reduction of the value (see :func:`reduction`)
    reduced: float | Tensor | None = None  # "max", "min", "sum": the micro-batches' values reduced so far

    def add(self, value: float | Tensor, weight: float) -> None:
        """One micro-batch's value; a mean ignores a micro-batch of weight 0 (nothing its loss
        averages over, whose token mean is NaN)."""
        self.calls += 1
        if self.reduce != "mean":
            self.reduced = value if self.reduced is None else combine(self.reduce, self.reduced, value)
        elif weight > 0:
            self.weighted_sum += value * weight
            self.weight += weight

    def result(self) -> float:
        """The batch's value: ``reduced`` for max/min/sum; for a mean, weighted by the given batch
        sizes where every call gave one, else by the micro-batches' weights."""
        if self.reduce != "mean":
            return float(self.reduced) if self.reduced is not None else float("nan")
        if self.sized_calls == self.calls and self.batch_size:
            return float(self.sized_sum) / self.batch_size
        return float(self.weighted_sum) / self.weight if self.weight else float("nan")


class StepRecorder:
    """Collects the loss and logged values of one batch's micro-batches on the last stage."""

    def __init__(self, items: float = 0.0) -> None:
        self.items = items  # what the batch's means average over: its samples, or what loss_weight counts
        self._loss_sum: Tensor | None = None  # on the loss's device: no GPU sync per micro-batch
        self._loss_weight = 0.0
        self.logged: dict[str, _Logged] = {}
        self.passthrough: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    @contextmanager
    def capture(self, module: pl.LightningModule, weight: float, keep: bool) -> Iterator[None]:
        """Route ``module.log`` to this recorder while a micro-batch's step runs. With ``keep`` false
        (stages before the last, whose step is cut short) the calls are dropped."""

        def log(*args: Any, **kwargs: Any) -> None:
            if keep:
                self._record(module, weight, args, kwargs)

        with internals.routed_log(module, log):  # these calls must not reach Lightning per micro-batch
            yield

    def _record(self, module: pl.LightningModule, weight: float, args: tuple, kwargs: dict) -> None:
        # runs for every micro-batch: the usual self.log(name, value, **options) skips binding the
        # signature, which costs more than the rest of the call
        if len(args) == 2 and _LOG_OPTIONS.issuperset(kwargs):
            (name, value), arguments = args, dict(kwargs)
        else:
            bound = _LOG_SIGNATURE.bind(module, *args, **kwargs)
            arguments = dict(bound.arguments)
            arguments.pop("self")
            name, value = arguments.pop("name"), arguments.pop("value")
        refuse_held(value, f"The value logged as {name!r}")  # a block container's read of another stage's block
        scalar = _as_scalar(value)
        if scalar is None:  # e.g. a torchmetrics Metric: its state lives on this rank; log it here once
            self.passthrough.append(((name, value), arguments))
            return
        entry = self.logged.get(name)
        if entry is None:
            entry = self.logged[name] = _Logged(reduce=reduction(arguments.get("reduce_fx", "mean")))
        entry.add(scalar, weight)
        size = arguments.pop("batch_size", None)
        if size is not None:
            entry.batch_size = (entry.batch_size or 0) + int(size)
            entry.sized_sum += scalar * int(size)
            entry.sized_calls += 1
        entry.kwargs = arguments

    def log_local(self, module: pl.LightningModule) -> None:
        """Log, once for the batch, the values that cannot be averaged (metric objects, updated by
        every micro-batch's step); they exist on the last stage only."""
        seen: set[str] = set()
        for (name, value), kwargs in self.passthrough:
            if name not in seen:
                seen.add(name)
                if hasattr(value, "sync_on_compute"):  # a torchmetrics Metric: no other rank has its state
                    internals.metric_sync_off(value)
                module.log(name, value, **kwargs)

    def add_loss(self, loss: Tensor, weight: float) -> None:
        """One micro-batch's loss and its share of the batch; a share of 0 adds nothing (its loss,
        a mean over no tokens, may be NaN)."""
        weighted = loss.detach().float() * weight if weight > 0 else torch.zeros((), device=loss.device)
        self._loss_sum = weighted if self._loss_sum is None else self._loss_sum + weighted
        self._loss_weight += weight

    def summary(self) -> dict[str, Any]:
        """Plain, picklable means: ``{"loss": float | None, "logs": [(name, mean, kwargs)], "items": N}``
        (``N``: the batch's items, the means' weight against other replicas'). The only place that
        reads the sums back from the device."""
        loss = None
        if self._loss_sum is not None:
            loss = float(self._loss_sum) / self._loss_weight if self._loss_weight else float("nan")
        logs = []
        for name, entry in self.logged.items():
            kwargs = dict(entry.kwargs)
            if entry.batch_size is not None:
                kwargs["batch_size"] = entry.batch_size
            logs.append((name, entry.result(), kwargs))
        return {"loss": loss, "logs": logs, "items": self.items}

    def portable(self) -> dict[str, Any]:
        """The sums so far as plain numbers, to be absorbed by another rank's recorder (see
        :func:`gather_recorders`); metric objects stay with this rank."""
        loss = float(self._loss_sum) if self._loss_sum is not None else None
        logged = {
            name: dict(
                entry.__dict__,
                weighted_sum=float(entry.weighted_sum),
                sized_sum=float(entry.sized_sum),
                reduced=float(entry.reduced) if entry.reduced is not None else None,
            )
            for name, entry in self.logged.items()
        }
        return {"loss": (loss, self._loss_weight), "logged": logged}

    def absorb(self, state: dict[str, Any]) -> None:
        """Add another recorder's :meth:`portable` sums to this one's: the batch's micro-batches whose
        steps ran there."""
        loss, weight = state["loss"]
        if loss is not None:
            self._loss_sum = torch.tensor(loss) if self._loss_sum is None else self._loss_sum + loss
            self._loss_weight += weight
        for name, other in state["logged"].items():
            entry = self.logged.setdefault(name, _Logged(reduce=other["reduce"]))
            if other["reduced"] is not None:
                entry.reduced = (
                    other["reduced"]
                    if entry.reduced is None
                    else combine(entry.reduce, entry.reduced, other["reduced"])
                )
            entry.weighted_sum += other["weighted_sum"]
            entry.weight += other["weight"]
            entry.calls += other["calls"]
            entry.sized_calls += other["sized_calls"]
            entry.sized_sum += other["sized_sum"]
            if other["batch_size"] is not None:
                entry.batch_size = (entry.batch_size or 0) + other["batch_size"]
            entry.kwargs = other["kwargs"]


def gather_recorders(recorder: StepRecorder, ranks: Sequence[int], rank: int, group: ProcessGroup | None) -> None:
    """Where a step's losses are computed on several ranks (Chimera's two pipelines end on the first
    and the last process), the earlier ``ranks`` send their recorder's sums to the last, which
    absorbs them and shares the step's summary as usual."""
    import torch.distributed as dist

    if rank in ranks[:-1]:
        dist.send_object_list([recorder.portable()], dst=ranks[-1], group=group)
    elif rank == ranks[-1]:
        for source in ranks[:-1]:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=source, group=group)
            recorder.absorb(box[0])


def _as_scalar(value: Any) -> float | Tensor | None:
    """A loggable single number (a one-element tensor stays a tensor, detached), or None."""
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.detach().float().reshape(())
    if isinstance(value, Number) and not isinstance(value, bool):
        return float(value)  # type: ignore[arg-type]
    return None


def step_loss(output: Any) -> Tensor | None:
    """The loss in what ``training_step`` returned: a tensor, or a mapping with ``"loss"``."""
    if output is None:
        return None
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    raise TypeError(
        "Under the pipeline, training_step must return the loss tensor or a dict with a 'loss' key, "
        f"got {type(output).__name__}."
    )


def replay(module: pl.LightningModule, summary: dict[str, Any], device: torch.device) -> None:
    """Log the batch's means through Lightning on this rank."""
    for name, value, kwargs in summary["logs"]:
        module.log(name, torch.tensor(value, device=device), **kwargs)


class SummaryBroadcaster:
    """Sends the last stage's step summary to every rank with one small broadcast per step.

    The names and options of the logged values rarely change between steps, so they go (pickled)
    only when they do; otherwise one float64 tensor carries the loss and the values. :meth:`post`
    starts the broadcast without waiting (asynchronous schedules read it a step later, so that no
    rank waits for the others between steps); :meth:`complete` finishes one. Every rank completes
    the posted broadcasts in the same order.
    """

    SLOTS = 64
    HEAD = 3  # kind of message, number of values, whether there is a loss

    def __init__(self, src: int, group: ProcessGroup | None, is_src: bool) -> None:
        self.src, self.group, self.is_src = src, group, is_src
        self._structure: list[tuple[str, dict[str, Any]]] | None = None
        self._sent_structure: list[tuple[str, dict[str, Any]]] | None = None

    def share(self, summary: dict[str, Any] | None) -> dict[str, Any]:
        return self.complete(self.post(summary))

    def post(self, summary: dict[str, Any] | None) -> tuple[Any, Tensor, dict[str, Any] | None]:
        import torch.distributed as dist

        buffer = torch.zeros(self.SLOTS, dtype=torch.float64)
        if self.is_src:
            assert summary is not None
            structure = [(name, kwargs) for name, _, kwargs in summary["logs"]]
            has_loss = summary["loss"] is not None
            values = [summary["loss"] if has_loss else 0.0, *(v for _, v, _ in summary["logs"])]
            fits = len(values) + self.HEAD <= self.SLOTS
            changed = structure != self._sent_structure
            self._sent_structure = structure
            buffer[0] = 2.0 if not fits else float(changed)
            if fits:
                buffer[1] = len(values)
                buffer[2] = float(has_loss)  # a flag, not NaN: a NaN loss is a value to report
                buffer[self.HEAD : self.HEAD + len(values)] = torch.tensor(values, dtype=torch.float64)
        work = dist.broadcast(buffer, self.src, group=self.group, async_op=True)
        return work, buffer, summary

    @staticmethod
    def needs_more(handle: tuple[Any, Tensor, dict[str, Any] | None]) -> bool:
        """On the sending rank: whether completing ``handle`` takes another (blocking) broadcast,
        which the receivers are already waiting for."""
        return int(handle[1][0]) != 0

    def complete(self, handle: tuple[Any, Tensor, dict[str, Any] | None]) -> dict[str, Any]:
        import torch.distributed as dist

        work, buffer, summary = handle
        work.wait()
        flag = int(buffer[0])
        if flag == 2:  # too many values for the tensor: send the whole summary
            box = [summary]
            dist.broadcast_object_list(box, self.src, group=self.group)
            return cast("dict[str, Any]", box[0])  # the sender's summary, on every rank
        if flag == 1:
            assert not self.is_src or summary is not None
            structure = (
                [(name, kwargs) for name, _, kwargs in summary["logs"]] if summary is not None and self.is_src else None
            )
            shared = [structure]
            dist.broadcast_object_list(shared, self.src, group=self.group)
            self._structure = shared[0]
        assert self._structure is not None
        count = int(buffer[1])
        values = buffer[self.HEAD : self.HEAD + count].tolist()
        loss = values[0] if buffer[2] != 0 else None
        logs = [(name, value, kwargs) for (name, kwargs), value in zip(self._structure, values[1:])]
        return {"loss": loss, "logs": logs}


class SummarySharing:
    """The last stage's step summaries on every rank of a pipeline, one broadcaster per kind of
    step (train, validation, ...).

    The last stage has its summary already and does not wait for its broadcast to arrive: it
    completes it before the next collective on the group (:meth:`finish_pending`), so its
    optimizer step overlaps the other stages' last backwards instead of waiting for them. The
    other stages finish their backwards after the last stage posted the broadcast, so receiving
    it costs them nothing. Asynchronous schedules post a step's summary and read it a step later
    (:meth:`post_lagged`, :meth:`take_lagged`), so that no rank waits for the others between steps.
    """

    def __init__(self, src: int, group: ProcessGroup | None, is_src: bool) -> None:
        self.src, self.group, self.is_src = src, group, is_src
        self._broadcasters: dict[str, SummaryBroadcaster] = {}
        self._unfinished: tuple[SummaryBroadcaster, Any] | None = None
        self._lagged: Any | None = None

    def _broadcaster(self, kind: str) -> SummaryBroadcaster:
        if kind not in self._broadcasters:
            self._broadcasters[kind] = SummaryBroadcaster(self.src, self.group, self.is_src)
        return self._broadcasters[kind]

    def share(self, kind: str, summary: dict[str, Any] | None) -> dict[str, Any]:
        """``summary`` (given on the last stage only) on every rank."""
        self.finish_pending()
        broadcaster = self._broadcaster(kind)
        handle = broadcaster.post(summary)
        if not self.is_src:
            return broadcaster.complete(handle)
        if broadcaster.needs_more(handle):  # new names: the receivers wait for them now
            broadcaster.complete(handle)
        else:
            self._unfinished = (broadcaster, handle)
        assert summary is not None
        return summary

    def finish_pending(self) -> None:
        """Complete the last stage's outstanding broadcast before the next collective on its group."""
        if self._unfinished is not None:
            broadcaster, handle = self._unfinished
            self._unfinished = None
            broadcaster.complete(handle)

    def take_lagged(self) -> dict[str, Any] | None:
        """The training summary posted by :meth:`post_lagged` a step ago, if any, on every rank."""
        self.finish_pending()
        if self._lagged is None:
            return None
        handle, self._lagged = self._lagged, None
        return self._broadcaster("train").complete(handle)

    def post_lagged(self, summary: dict[str, Any] | None) -> None:
        """Start sharing this training step's summary, to be read by the next step."""
        self._lagged = self._broadcaster("train").post(summary)
