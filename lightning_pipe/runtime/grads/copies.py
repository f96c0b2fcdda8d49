"""Chimera's two copies of every stage: which ranks pair up, and which micro-batches reach a copy.

Under Chimera process ``i`` holds stage ``i`` of the down pipeline and stage ``D - 1 - i`` of the
up pipeline, and process ``D - 1 - i`` the same two stages the other way round: the pair holds the
same parameters. Each copy gets the gradient of its own pipeline's micro-batches; the pair sums
them before the optimizer step (like replicas, without the mean), so that both copies take the same
update as plain training and stay equal. Weights tied across stages are summed by their tie
(over every rank holding a copy) instead, and parameters outside the split Sequential over the
pipeline, as under the other schedules. A block container's ends go with their stage: the pair
holding the first and last split stages holds the embeddings and the head, each copy used by its
own pipeline's micro-batches, and sums their gradients as the stage's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed import ProcessGroup

from lightning_pipe.runtime.grads.gradients import Copies
from lightning_pipe.runtime.topology import Placement
from lightning_pipe.schedules import Schedule


def stage_copies(
    placement: Placement,
    group: Callable[[list[int]], ProcessGroup],
    host: nn.Module,
    tied: Iterable[nn.Parameter],
    ends: Iterable[nn.Parameter] = (),
) -> Copies:
    """This rank's :class:`~lightning_pipe.runtime.grads.gradients.Copies`: the pair's group (every rank
    creates every pair's, in the same order, as ``torch.distributed.new_group`` requires), the
    trainable parameters of ``host`` and ``ends`` (a block container's embeddings and head held with
    the end stages) that are not ``tied``, and whether this rank counts them in the global norm (the
    pair's first does)."""
    d, ranks = placement.num_stages, placement.pipeline_ranks
    mine: Any = None
    for i in range(d // 2):
        pair_group = group([ranks[i], ranks[d - 1 - i]])
        if placement.stage in (i, d - 1 - i):
            mine = pair_group
    skip = {id(p) for p in tied}
    params = [p for p in [*host.parameters(), *ends] if p.requires_grad and id(p) not in skip]
    return Copies(mine, params, placement.stage < d // 2)


def reaching(schedule: Schedule, stages: Mapping[int, nn.Module]) -> dict[int, int]:
    """For each parameter of this rank's ``stages`` (by ``id``), how many of the schedule's
    micro-batches go through the stage that holds it (its pipeline's share)."""
    counts: dict[int, int] = {}
    for stage, module in stages.items():
        n = sum(1 for i in range(schedule.num_microbatches) if stage in schedule.chain_stages(i))
        for param in module.parameters():
            counts[id(param)] = counts.get(id(param), 0) + n
    return counts


def written_elsewhere(stages: Mapping[int, nn.Module], num_split: int, prefix: str) -> frozenset[str]:
    """The state-dict names of this rank's second copies (schedule stages ``num_split`` and up): the
    rank holding the down pipeline's copy writes them, so a checkpoint holds each stage once, as
    1F1B's does."""
    own = {f"{prefix}{n}" for s, m in stages.items() if s < num_split for n in m.state_dict()}
    copies = {f"{prefix}{n}" for s, m in stages.items() if s >= num_split for n in m.state_dict()}
    return frozenset(copies - own)


def renamed_ties(host: nn.Module, skip: frozenset[str], prefix: str) -> dict[str, str]:
    """For a weight tied across stages whose first name on this rank (the optimizer's) is in ``skip``
    (a copy another rank writes), that name -> the name this rank writes it under (its own stage's)."""
    names: dict[int, list[str]] = {}
    for name, param in host.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(f"{prefix}{name}")
    renamed = {}
    for held in names.values():
        kept = [n for n in held if n not in skip]
        if held[0] in skip and kept:
            renamed[held[0]] = kept[0]
    return renamed


def loss_ranks(schedule: Schedule, pipeline_ranks: Sequence[int]) -> list[int]:
    """The global ranks holding a last stage, where the user's step computes losses; the last stage
    of the whole split (the one the others send their results to) last."""
    lasts = [schedule.rank_of((c + 1) * schedule.chain_length - 1) for c in range(schedule.chains)]
    return [pipeline_ranks[r] for r in dict.fromkeys(lasts)]
