"""Under an asynchronous schedule, a parameter outside the split layers that every stage holds (a
block container's position embeddings or final norm, a Sequential's pre- or post-processing) is
used by one stage: the stage whose part of the step reaches the loss through it. Its gradient comes
from that stage at that stage's delay, summed over the stages as in synchronous training, so every
copy takes the same update while the stages step with the same learning rate. PipeMare's
learning-rate rescheduling gives each stage its own step size: there the copy of the stage that
uses the parameter is the one the rule gives, and after each update the other stages take it
from that stage (:class:`OutsideOwners`), so every copy, and what a checkpoint saves, stays the
user's. Only where the rescheduled step sizes differ is this needed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


def owners_from_flags(flags: Tensor, names: Sequence[str], known: Sequence[int | None]) -> list[int | None]:
    """Per parameter, the stage whose gradient it got (``flags[s, i]``: stage ``s`` gave parameter ``i``
    a gradient this step), keeping the owners ``known`` from earlier steps. Two stages giving one a
    gradient under different step sizes cannot both be followed: refused, naming it."""
    owners = list(known)
    for i, name in enumerate(names):
        givers = [s for s in range(flags.shape[0]) if flags[s, i] > 0]
        if not givers:
            continue
        known_owner = owners[i]
        if len(givers) > 1 or (known_owner is not None and known_owner != givers[0]):
            seen = sorted({*givers, *([known_owner] if known_owner is not None else [])})
            raise RuntimeError(
                f"The parameter {name!r} outside the split layers gets gradients on pipeline stages {seen}, which "
                "PipeMare's learning-rate rescheduling steps with different step sizes, so its copies would not "
                "agree. Set pipemare_warmup=0 (no rescheduling), or move the module that holds it into the split "
                "layers of one stage."
            )
        owners[i] = givers[0]
    return owners


class OutsideOwners:
    """The stages using each parameter outside the split layers that every stage holds, and their
    copies handed to the other stages after each update (see the module docstring).

    Args:
        params: those parameters (trainable), by name, in the same order on every stage.
        stage: this rank's stage.
        num_stages: stages of the pipeline.
        group: the pipeline's process group, its ranks in stage order (None: the default group).
    """

    def __init__(self, params: Mapping[str, nn.Parameter], stage: int, num_stages: int, group: Any) -> None:
        self.names = list(params)
        self.params = list(params.values())
        self.stage = stage
        self.num_stages = num_stages
        self.group = group
        self.owners: list[int | None] = [None] * len(self.params)

    def note(self, given: Mapping[nn.Parameter, Tensor | None]) -> None:
        """Before the gradients are summed over the stages: which of the parameters this stage gives
        a gradient now (``given``), agreed with every stage (a collective)."""
        if not self.params:
            return
        device = self.params[0].device
        mine = torch.tensor([float(given.get(p) is not None) for p in self.params], device=device)
        flags = torch.zeros(self.num_stages, len(self.params), device=device)
        flags[self.stage] = mine
        dist.all_reduce(flags, group=self.group)
        self.owners = owners_from_flags(flags, self.names, self.owners)

    def hand_out(self) -> None:
        """After the update: every stage takes each parameter from the stage that uses it (a collective)."""
        for owner in sorted({o for o in self.owners if o is not None}):
            mine = [p for p, o in zip(self.params, self.owners) if o == owner]
            flat = torch.cat([p.detach().reshape(-1) for p in mine])
            src = dist.get_global_rank(self.group, owner) if self.group is not None else owner
            dist.broadcast(flat, src=src, group=self.group)
            if owner == self.stage:
                continue
            with torch.no_grad():
                offset = 0
                for p in mine:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()


def qualified(name: str, stage: int) -> str:
    """The name under which stage ``stage`` saves its own part of the state of ``name``, a parameter
    every stage holds (its unapplied gradient, its PipeMare velocity): one entry per stage, since a
    checkpoint merges the stages' states by name."""
    return f"{name}@stage{stage}"


def qualify(named: Mapping[str, Any], everywhere: set[str], stage: int) -> dict[str, Any]:
    """``named`` with the names in ``everywhere`` qualified by ``stage`` (see :func:`qualified`)."""
    return {qualified(n, stage) if n in everywhere else n: v for n, v in named.items()}


def unqualify(named: Mapping[str, Any], local: set[str], everywhere: set[str], stage: int) -> dict[str, Any]:
    """This stage's entries of a merged state: those of ``local`` names, and its own of ``everywhere``."""
    out = {n: v for n, v in named.items() if n in local and n not in everywhere}
    out.update((n, named[qualified(n, stage)]) for n in everywhere if qualified(n, stage) in named)
    return out
