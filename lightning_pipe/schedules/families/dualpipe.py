"""DualPipeV (DeepSeek-V3's DualPipe folded onto half the ranks, as ``torch.distributed.pipelining``'s
``ScheduleDualPipeV`` and DeepSeek's ``dualpipev.py`` build it).

DualPipe runs two pipelines in opposite directions, as Chimera does, and pairs one micro-batch's
forward with another's backward ("F&B") so that one's communication hides behind the other's
compute. DualPipeV keeps ZB-V's placement (rank ``r`` holds stages ``r`` and ``2p - 1 - r`` of
``2p``, so rank 0 holds the first and the last): a micro-batch goes down the first half of the V and
back up the second, and the two directions are the two legs of the V. The order per rank:

1. ``2(p - r - 1)`` forwards on the down stage, then ``r + 1`` pairs of forwards (down, up);
2. ``p - r - 1`` rounds of up-stage input gradient (B), a pending weight gradient (W), up forward;
3. the main phase: F&B pairs, forward on one leg with a whole backward (B then W) on the other,
   alternating legs, ``m - 2p + r + 1`` times two (the last rank's first pair runs unpaired);
4. the drain: whole up backwards paired with down F&B's, then backwards on both legs, the second
   half of them split (B now, W into the cool-down), as zero bubble does.

DeepSeek's table (``PP`` stages on ``PP / 2`` ranks): bubble ``(PP/2 - 1)(F&B + B - 3W)``, twice the
weights, ``PP + 1`` micro-batches' activations. It needs ``m >= 2p`` micro-batches. The F&B pairs
are data (:attr:`~lightning_pipe.schedules.actions.Schedule.overlapped`): the executor posts both
halves' communication before either computes and may run them at once.
"""

from __future__ import annotations

from lightning_pipe.schedules.actions import Action, B, F, Schedule, W
from lightning_pipe.schedules.comm import with_communication
from lightning_pipe.schedules.families.interleaved import check_counts
from lightning_pipe.schedules.families.zero_bubble import zbv_stage_to_rank


def dualpipev_min_chunks(num_ranks: int) -> int:
    """The fewest micro-batches DualPipeV runs on ``num_ranks``: one per stage, ``2 x num_ranks``."""
    return 2 * num_ranks


def check_dualpipev(num_ranks: int, num_microbatches: int) -> None:
    """Reject counts DualPipeV cannot run, naming the smallest valid chunks."""
    check_counts(num_ranks, num_microbatches, 2)
    least = dualpipev_min_chunks(num_ranks)
    if num_microbatches < least:
        raise ValueError(
            f"schedule='dualpipev' needs at least one micro-batch per stage: chunks >= 2 x processes = {least} "
            f"with {num_ranks} processes, got {num_microbatches} micro-batches. Use chunks={least} or more (and "
            f"batches of at least {least} samples: drop_last=True in the DataLoader for a short last one), or "
            "schedule='zbv' (the same V placement, any chunks)."
        )


class _Order:
    """One rank's compute order as it is built: counters per (stage, kind), pending W's, F&B pairs."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.pairs: list[tuple[Action, ...]] = []
        self.next: dict[tuple[str, int], int] = {}
        self.weights: list[Action] = []  # W's of split backwards, oldest first

    def _take(self, kind: str, stage: int) -> int:
        i = self.next.get((kind, stage), 0)
        self.next[(kind, stage)] = i + 1
        return i

    def forward(self, stage: int) -> list[Action]:
        action = F(stage, self._take("F", stage))
        self.actions.append(action)
        return [action]

    def backward(self, stage: int, split: bool = False) -> list[Action]:
        """B; its W comes right after (a whole backward) or, ``split``, from :meth:`weight` later."""
        i = self._take("B", stage)
        if split:
            self.weights.append(W(stage, i))
            self.actions.append(B(stage, i))
            return [B(stage, i)]
        self.actions += [B(stage, i), W(stage, i)]
        return [B(stage, i), W(stage, i)]

    def weight(self) -> None:
        if self.weights:
            self.actions.append(self.weights.pop(0))

    def overlapped(self, forward_stage: int, backward_stage: int) -> None:
        """An F&B pair: a forward on one leg and a whole backward on the other."""
        self.pairs.append((*self.forward(forward_stage), *self.backward(backward_stage)))


def _dualpipev_order(p: int, m: int, rank: int) -> _Order:
    down, up = rank, 2 * p - 1 - rank
    o = _Order()
    for _ in range(2 * (p - rank - 1)):
        o.forward(down)
    for _ in range(rank + 1):
        o.forward(down)
        o.forward(up)
    for _ in range(p - rank - 1):
        o.backward(up, split=True)
        o.weight()
        o.forward(up)
    for i in range(m - 2 * p + rank + 1):
        if i == 0 and rank == p - 1:  # the turn of the V: unpaired, which shortens the bubble
            o.forward(down)
            o.backward(up)
        else:
            o.overlapped(down, up)
        o.overlapped(up, down)
    for _ in range(p - rank - 1):
        o.backward(up)
        o.overlapped(up, down)
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        o.backward(up, split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        o.backward(down, split)
    for _ in range(p - rank - 1):
        o.weight()
        o.backward(down, split)
    for _ in range(rank + 1):
        o.weight()
    return o


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV on ``2 x num_ranks`` stages, two per rank in a V, with its F&B pairs; needs
    ``num_microbatches >= 2 x num_ranks``."""
    check_dualpipev(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    orders = [_dualpipev_order(p, m, r) for r in range(p)]
    return with_communication(
        "dualpipev",
        [o.actions for o in orders],
        2 * p,
        m,
        zbv_stage_to_rank(p),
        split_backward=True,
        overlapped=[o.pairs for o in orders],
    )


def table_bubble(num_ranks: int, forward: float, backward: float, weight: float, overlapped: float) -> float:
    """DeepSeek's DualPipeV bubble per rank, ``(PP/2 - 1)(F&B + B - 3W)`` with ``PP / 2 = num_ranks``:
    ``backward`` is a whole backward (input and weight gradient), ``overlapped`` an F&B pair's time."""
    return (num_ranks - 1) * (overlapped + backward - 3 * weight)
