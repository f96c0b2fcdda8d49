"""Optimizer states keyed by parameter name, so that a checkpoint loads under any layout, and back
to positions in the unsplit module's order for the plain file a consolidation writes."""

from __future__ import annotations

import heapq
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from torch.optim import Optimizer


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> its name, the first of its names (as ``named_parameters`` gives it)."""
    return {id(p): name for name, p in module.named_parameters()}


def optimizer_state_by_name(
    optimizer: Optimizer, names: Mapping[int, str], aliases: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names instead of positions.

    ``names`` maps ``id(parameter)`` to its name in the unsplit module; ``aliases`` (see
    :func:`tie_aliases`) are kept with it for consolidation.
    """
    state = optimizer.state_dict()
    position_to_name: dict[int, str] = {}
    position = 0
    groups = []
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        group_names = []
        for param in group["params"]:
            position_to_name[position] = names[id(param)]
            group_names.append(names[id(param)])
            position += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": group_names})
    by_name = {position_to_name[p]: value for p, value in state["state"].items()}
    named: dict[str, Any] = {"state": by_name, "param_groups": groups}
    if aliases:
        named["aliases"] = dict(aliases)
    return named


def tie_aliases(ties: Sequence[Mapping[int, str]], position: int, prefix: str) -> dict[str, str]:
    """The names on pipeline ``position`` of weights tied to a layer of an earlier stage (each tie
    as ``{position: name in the Sequential}``, the first stage's first), with the name the unsplit
    module gives the tensor: the first stage's. The unsplit optimizer holds such a tensor once."""
    aliases = {}
    for tie in ties:
        first = next(iter(tie))
        if position in tie and position != first:
            aliases[prefix + tie[position]] = prefix + tie[first]
    return aliases


def optimizer_state_by_position(named: Mapping[str, Any], order: Sequence[Sequence[str]]) -> dict[str, Any]:
    """The inverse: a ``state_dict`` for an optimizer whose groups hold the parameters named in
    ``order`` (one list per group), taking the states that exist under those names."""
    if len(order) != len(named["param_groups"]):
        raise ValueError(
            f"The checkpoint's optimizer has {len(named['param_groups'])} parameter groups but this one has "
            f"{len(order)}; configure_optimizers must build the same groups."
        )
    state: dict[int, Any] = {}
    groups = []
    position = 0
    for saved, group_names in zip(named["param_groups"], order):
        positions = []
        for name in group_names:
            if name in named["state"]:
                state[position] = named["state"][name]
            positions.append(position)
            position += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": positions})
    return {"state": state, "param_groups": groups}


def merge_optimizer_states(per_stage: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One optimizer's by-name state over all stages: states unioned, group members merged in the
    unsplit module's order (each stage lists its members in that order). A tied weight's copies on
    later stages are no members (the unsplit optimizer holds the tensor once, under its first name,
    and the copies' states equal its own: their gradients are summed); their states stay, for a
    pipeline that resumes them. The groups' hyper-parameters are stage 0's: every stage saves the
    same ones (:func:`differing_hyperparameters`; reading a checkpoint refuses stages that differ)."""
    state: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for part in per_stage:
        state.update(part["state"])
        aliases.update(part.get("aliases") or {})
    listed = {name for part in per_stage for group in part["param_groups"] for name in group["params"]}
    copies = {alias for alias, name in aliases.items() if name in listed}
    groups = []
    for g, first in enumerate(per_stage[0]["param_groups"]):
        members = merge_orders([part["param_groups"][g]["params"] for part in per_stage])
        members = [name for name in members if name not in copies]
        groups.append({**{k: v for k, v in first.items() if k != "params"}, "params": members})
    return {"state": state, "param_groups": groups}


def differing_hyperparameters(
    per_optimizer: Sequence[Mapping[str, Any]] | None, reference: Sequence[Mapping[str, Any]]
) -> str | None:
    """The first difference between two stages' saved hyper-parameters (every group key but its
    parameters, per optimizer), as ``"optimizer 0, parameter group 1: momentum 0.8 against 0.9"``;
    None where they agree."""
    if per_optimizer is None or len(per_optimizer) != len(reference):
        count = "none" if per_optimizer is None else len(per_optimizer)
        return f"{count} optimizers against {len(reference)}"
    for i, (mine, theirs) in enumerate(zip(per_optimizer, reference)):
        groups, others = mine["param_groups"], theirs["param_groups"]
        if len(groups) != len(others):
            return f"optimizer {i}: {len(groups)} parameter groups against {len(others)}"
        for g, (group, other) in enumerate(zip(groups, others)):
            for key in sorted(set(group) | set(other), key=str):
                if key == "params":
                    continue
                a, b = group.get(key, "<missing>"), other.get(key, "<missing>")
                if not _same(a, b):
                    return f"optimizer {i}, parameter group {g}: {key} {a!r} against {b!r}"
    return None


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN included (a hyper-parameter may be NaN alike on every stage)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # no boolean comparison (a tensor in a group): compare the text
        return repr(a) == repr(b)


#: a name's sort key: per dotted part, its runs of digits (compared as numbers) and of other text
NaturalKey = tuple[tuple[tuple[int, int, str], ...], ...]


def merge_orders(lists: Sequence[Sequence[str]]) -> list[str]:
    """The one order consistent with every list (each a subsequence of it) that follows the layer
    indices of the names where the lists leave a choice: a process may hold non-adjacent stages
    (interleaved schedules hold stages 0 and 2, ZB-V 0 and 3), so the files' order is not the
    module's. Parameters outside the Sequential appear in every list and pin the stages' parameters
    around them."""
    after: dict[str, set[str]] = {}
    incoming: dict[str, int] = {}
    rank: dict[str, NaturalKey] = {}
    for names in lists:
        for name in names:
            rank.setdefault(name, _natural_key(name))
            after.setdefault(name, set())
            incoming.setdefault(name, 0)
        for a, b in itertools.pairwise(names):
            if b not in after[a]:
                after[a].add(b)
                incoming[b] += 1
    ready = [(rank[n], n) for n, count in incoming.items() if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for nxt in after[name]:
            incoming[nxt] -= 1
            if incoming[nxt] == 0:
                heapq.heappush(ready, (rank[nxt], nxt))
    if len(order) != len(rank):
        raise ValueError("The stages list their optimizer parameters in contradicting orders.")
    return order


def _natural_key(name: str) -> NaturalKey:
    """``layers.10.weight`` after ``layers.9.bias``, ``encoder_layer_10`` after ``encoder_layer_9`` (a
    Sequential built from an ``OrderedDict``): numbers compare as numbers, wherever they are in a
    part, the rest as text."""
    return tuple(
        tuple((0, int(piece), "") if piece.isdigit() else (1, 0, piece) for piece in re.split(r"(\d+)", part) if piece)
        for part in name.split(".")
    )


def plain_state_by_name(
    plain: Mapping[str, Any], stages: Sequence[Mapping[str, Any]], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, Any]:
    """A plain (unsplit) optimizer's ``state_dict``, keyed by position, keyed by name instead: the
    stages' by-name groups (``stages``: every rank's, from :func:`optimizer_state_by_name`, states
    left out), merged in the unsplit module's order, name the plain groups' positions, as a
    consolidation writes them. ``shapes``: this rank's parameters' shapes, to check the mapping.
    Raises ValueError where the groups do not match."""
    merged = merge_optimizer_states([{"state": {}, **stage} for stage in stages])
    groups, state = [], {}
    if len(plain["param_groups"]) != len(merged["param_groups"]):
        raise ValueError(
            f"the checkpoint's optimizer has {len(plain['param_groups'])} parameter groups, this one "
            f"{len(merged['param_groups'])}"
        )
    for g, (saved, names) in enumerate(zip(plain["param_groups"], merged["param_groups"])):
        if len(saved["params"]) != len(names["params"]):
            raise ValueError(
                f"parameter group {g} holds {len(saved['params'])} parameters in the checkpoint, "
                f"{len(names['params'])} here"
            )
        for position, name in zip(saved["params"], names["params"]):
            if position in plain["state"]:
                state[name] = plain["state"][position]
                wrong = [
                    k
                    for k, v in state[name].items()
                    if name in shapes and getattr(v, "dim", lambda: 0)() > 0 and tuple(v.shape) != shapes[name]
                ]
                if wrong:
                    raise ValueError(f"the state {wrong[0]} of position {position} does not fit {name}")
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": list(names["params"])})
    aliases = {alias: name for stage in stages for alias, name in (stage.get("aliases") or {}).items()}
    state.update({alias: state[name] for alias, name in aliases.items() if name in state})
    return {"state": state, "param_groups": groups}
