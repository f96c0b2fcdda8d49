"""What happens to a stage's gradients between its backward and the optimizer step.

The schedule runs every micro-batch's backward inside ``training_step``, before Lightning zeroes
the gradients for the step; the gradients are kept aside (:meth:`StageGradients.take`) and handed
to the parameters in ``backward`` (:meth:`StageGradients.hand_over`), where the cross-rank sums
happen: parameters outside the split Sequential (each stage computed a part of their gradient),
weights tied across stages (each copy got the gradient of its own use) and, with data-parallel
replicas, the average over the replicas of the stage. Clipping by the global norm
(:meth:`StageGradients.clip_grad_norm_`) counts every gradient held on several ranks once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_pipe.runtime.grads.flat import FlatAllReduce, add_grad
from lightning_pipe.runtime.grads.replica_grads import ReplicaReducer
from lightning_pipe.runtime.replicas.sharding import local
from lightning_pipe.runtime.topology import Layout

#: Gradients kept aside per parameter (None: the parameter got no gradient).
Pending = dict[nn.Parameter, Tensor | None]


class Tie(NamedTuple):
    """A weight tied across stages on this rank."""

    #: the process group of the stages holding a copy
    group: Any
    #: this rank's copy
    param: nn.Parameter
    #: whether this rank counts it in the global norm (the lowest stage of the tie does)
    counted: bool


class Copies(NamedTuple):
    """Chimera's second copy of this rank's stages, on another rank."""

    #: the pair's process group
    group: Any
    #: the parameters whose gradients the pair sums (not the tied ones, which their tie sums over every holder)
    params: list[nn.Parameter]
    #: whether this rank counts them in the global norm (one of the pair does)
    counted: bool


def tie_groups(
    ties: Sequence[dict[int, str]],
    layout: Layout,
    stage: int,
    replica: int,
    local_params: Mapping[str, nn.Parameter],
    new_group: Callable[[list[int]], ProcessGroup] = dist.new_group,
) -> list[Tie]:
    """This rank's :class:`Tie` of each weight in ``ties`` (stage -> parameter name) that its stage
    holds (``local_params``: this rank's parameters by every name that reaches them). Every rank
    takes part in creating every tie's group, one per replica, as ``torch.distributed.new_group``
    requires (``new_group`` may hand out groups created before)."""
    found: list[Tie] = []
    for tie in ties:
        for r in range(layout.replicas):
            group = new_group([layout.rank(s, r) for s in sorted(tie)])
            if stage in tie and r == replica:
                found.append(Tie(group, local_params[tie[stage]], stage == min(tie)))
    return found


def swap_grads(params: Iterable[nn.Parameter], replacement: Pending) -> Pending:
    """Give ``params`` the gradients in ``replacement`` (None for those missing) and return the
    ones they had."""
    current: Pending = {}
    for param in params:
        current[param] = param.grad
        param.grad = replacement.get(param)
    return current


class StageGradients:
    """The gradient handling of one rank's stage.

    Args:
        shared: parameters outside the split Sequential (on every stage), in a fixed order.
        ties: weights tied across stages held by this stage (see :class:`Tie`).
        pp_group: the pipeline's stages (None: the default group), where ``shared`` is summed.
        num_stages: stages of the pipeline.
        counts_shared: whether this rank counts ``shared`` in the global norm (one stage does).
        norm_group: the ranks over which the global norm is summed (None: the default group).
        dp_group: the replicas of this stage (None: no data parallelism); their gradients are
            averaged in buckets of about ``bucket_bytes``.
        copies: Chimera's other copy of this rank's stages (see :class:`Copies`); the pair's gradients
            are summed in buckets as the replicas' are averaged, while the backward runs.
    """

    def __init__(  # noqa: PLR0913  built by StagePipeline.__init__ (typed config's refactor)
        self,
        shared: Sequence[nn.Parameter],
        ties: Sequence[Tie],
        pp_group: ProcessGroup,
        num_stages: int,
        counts_shared: bool,
        norm_group: ProcessGroup | None = None,
        dp_group: ProcessGroup | None = None,
        bucket_bytes: int = 25 * 2**20,
        copies: Copies | None = None,
    ) -> None:
        self.shared = list(shared)
        self.ties = list(ties)
        self.pp_group = pp_group
        self.num_stages = num_stages
        self.counts_shared = counts_shared
        self.norm_group = norm_group
        self.dp_group = dp_group
        self.bucket_bytes = bucket_bytes
        self.pending: Pending = {}
        self._buckets: list[FlatAllReduce] = []
        self.reducer: ReplicaReducer | None = None  # set by :meth:`overlap`
        self._reducing = False
        self.copies = copies
        if copies is not None:
            self.reducer = ReplicaReducer(copies.params, copies.group, bucket_bytes, mean=False)

    def overlap(self, params: Sequence[nn.Parameter]) -> None:
        """Average over the replicas while the backward runs (see
        :class:`lightning_pipe.runtime.grads.replica_grads.ReplicaReducer`), between :meth:`begin` and
        :meth:`take`; gradients given to :meth:`keep` directly are averaged after their backward."""
        if self.dp_group is not None and self.reducer is None:
            self.reducer = ReplicaReducer(params, self.dp_group, self.bucket_bytes)

    def close(self) -> None:
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None

    def begin(self, microbatches: int, per_param: dict[int, int] | None = None) -> None:
        """A step's backwards of ``microbatches`` micro-batches start (all ``.grad`` are None now);
        ``per_param``: how many of them reach a parameter, by ``id``, where not all do."""
        if self.reducer is not None:
            self.reducer.start(microbatches, per_param)
            self._reducing = True

    def take(self, params: Iterable[nn.Parameter], saved: Pending) -> None:
        """Keep the gradients the schedule just produced aside and give back the ``saved`` ones."""
        if self._reducing:
            assert self.reducer is not None
            self._reducing = False
            self.reducer.finish()
            self.pending = swap_grads(params, saved)
            return
        self.keep(swap_grads(params, saved))

    def keep(self, pending: Pending) -> None:
        """Keep ``pending`` for :meth:`hand_over`; with replicas, start averaging it over them now
        (asynchronously: it runs while the step's summary is shared and Lightning zeroes ``.grad``)."""
        self.pending = pending
        if self.dp_group is None:
            return
        ready = [(p, g) for p, g in reversed(list(pending.items())) if g is not None]  # backward order
        bucket: list[Tensor] = []
        size = 0
        for i, (_param, grad) in enumerate(ready):
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            last = i == len(ready) - 1
            if size >= self.bucket_bytes or last or ready[i + 1][1].dtype != grad.dtype:
                self._buckets.append(FlatAllReduce(bucket, self.dp_group))
                bucket, size = [], 0

    def _finish_replicas(self) -> None:
        """Wait for the replicas' sums and leave their means in the kept gradients."""
        if self.reducer is not None:
            self.reducer.wait()
        buckets, self._buckets = self._buckets, []
        if buckets:
            replicas = dist.get_world_size(self.dp_group)
            for bucket in buckets:
                bucket.wait(replicas)

    def hand_over(self, scale: float) -> None:
        """Sum the kept gradients across ranks where needed and add them, times ``scale``, into
        ``.grad`` (which Lightning may have zeroed since the schedule ran)."""
        pending, self.pending = self.pending, {}
        self._finish_replicas()
        self._all_reduce_shared(pending)
        self._all_reduce_tied(pending)
        for param, grad in pending.items():
            if grad is None:
                continue
            add_grad(param, grad.mul_(scale) if scale != 1.0 else grad)

    def _all_reduce_tied(self, pending: Pending) -> None:
        """Sum the gradients of a weight tied across stages over the stages that hold a copy, so
        the copies (equal from the start) take equal updates. A weight that no copy got a gradient
        for (frozen, or unused) keeps none, as in plain training."""
        for tie in self.ties:
            group, param = tie.group, tie.param
            grad = pending.get(param)
            got = torch.tensor([float(grad is not None)], device=param.device)
            dist.all_reduce(got, group=group)
            if not got.item():
                pending[param] = None
                continue
            total = grad if grad is not None else torch.zeros_like(param)
            dist.all_reduce(local(total), group=group)  # a sharded copy: replica r's rows, as on every stage
            pending[param] = total

    def _all_reduce_shared(self, pending: Pending) -> None:
        """Sum this batch's gradients of parameters outside the Sequential over the stages: each
        stage computed the part of them its own piece of ``forward`` used. Which of them got a
        gradient on some stage is summed in the same buffer: one that got none anywhere (frozen, or
        unused) keeps ``.grad`` None, as in plain training, so the optimizer leaves it alone (weight
        decay included)."""
        if not self.shared or self.num_stages == 1:
            return
        got = [pending.get(p) is not None for p in self.shared]
        grads = [g if (g := pending.get(p)) is not None else torch.zeros_like(p) for p in self.shared]
        flags = torch.tensor(got, dtype=self.shared[0].dtype, device=self.shared[0].device)
        FlatAllReduce([*map(local, grads), flags], self.pp_group, async_op=False).wait()  # shards: row by row
        pending.update((p, g if anywhere else None) for p, g, anywhere in zip(self.shared, grads, flags.tolist()))

    def clip_grad_norm_(self, parameters: Sequence[nn.Parameter], max_norm: float, device: torch.device) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` with the 2-norm taken over every stage's gradients.
        Parameters outside the Sequential and weights tied across stages hold the same gradient on
        several ranks and count once."""
        once = {id(p) for p in self.shared} if not self.counts_shared else set()
        once |= {id(tie.param) for tie in self.ties if not tie.counted}
        if self.copies is not None and not self.copies.counted:
            once |= {id(p) for p in self.copies.params}
        grads = [p.grad for p in parameters if p.grad is not None]
        counted = [p.grad for p in parameters if p.grad is not None and id(p) not in once]
        square = torch.zeros((), dtype=torch.float32, device=device)
        for g in counted:
            square += local(g.detach()).float().pow(2).sum()  # a shard counts its own part
        if self.num_stages > 1 or (self.norm_group is None and dist.is_initialized() and dist.get_world_size() > 1):
            dist.all_reduce(square, group=self.norm_group)
        total = square.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            local(g.detach()).mul_(coef.to(g.dtype))
        return total
