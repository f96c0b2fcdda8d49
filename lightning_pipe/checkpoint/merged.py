"""One view over every stage's shard: the whole state dict, each optimizer's state by name, an
asynchronous schedule's pending gradients, elastic averaging's center and replicas."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor

from lightning_pipe.checkpoint.optimizer_state import merge_optimizer_states
from lightning_pipe.runtime.asynchronous.delay_correction import merged_correction_state


def merged_state_dict(shards: Iterable[Mapping[str, Any]], order: Sequence[str] = ()) -> dict[str, Tensor]:
    """Every stage's tensors in one dict, in ``order`` (the unsplit module's, from the metadata) where given:
    the shards come by process, and a process may hold the first and the last stage."""
    merged: dict[str, Tensor] = {}
    for shard in shards:
        merged.update(shard["state_dict"])
    rank = {name: i for i, name in enumerate(order)}
    return dict(sorted(merged.items(), key=lambda item: rank.get(item[0], len(rank)))) if rank else merged


def merged_optimizer_states(shards: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]] | None:
    if any(shard.get("optimizer_states") is None for shard in shards):
        return None
    count = len(shards[0]["optimizer_states"])
    return [merge_optimizer_states([shard["optimizer_states"][i] for shard in shards]) for i in range(count)]


def merged_async_state(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """An asynchronous schedule's state over all stages: the step counter and, per batch, the
    unapplied gradient of every layer (by name): the replicas' mean, and with replicas each one's
    own (``replica_pending``, in replica order)."""
    found = [(shard.get("extra") or {}).get("async") for shard in shards]
    states = [state for state in found if state is not None]
    if len(states) < len(found):
        return None
    pending: dict[int, dict[str, Any]] = {}
    for state in states:
        for batch, grads in state["pending"].items():
            pending.setdefault(int(batch), {}).update(grads)
    merged: dict[str, Any] = {"step": states[0]["step"], "pending": pending}
    if all(state.get("replica_pending") is not None for state in states):  # each replica's own, per stage
        replicas: list[dict[int, dict[str, Any]]] = [{} for _ in states[0]["replica_pending"]]
        for state in states:
            for mine, theirs in zip(replicas, state["replica_pending"]):
                for batch, grads in theirs.items():
                    mine.setdefault(int(batch), {}).update(grads)
        merged["replica_pending"] = replicas
    if all("pipemare" in state for state in states):  # PipeMare: the update count and every stage's velocity
        velocity: dict[str, Any] = {}
        for state in states:
            velocity.update(state["pipemare"]["velocity"])
        merged["pipemare"] = {"updates": states[0]["pipemare"]["updates"], "velocity": velocity}
    correction = merged_correction_state(states)
    if correction is not None:
        merged["delay_correction"] = correction
    return merged


def merged_elastic_state(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """``replicas_sync="elastic"``: every stage's saved state as one (``{"elastic": ...}``): the step
    count, the center by name over all stages, and each stage's own entry (for a resume under the
    same layout; see :mod:`lightning_pipe.runtime.replicas.elastic_averaging`)."""
    states = [(shard.get("extra") or {}).get("elastic") for shard in shards]
    if not states or any(state is None for state in states):
        return None
    center: dict[str, Tensor] = {}
    for state in states:
        center.update(state["center"])  # type: ignore[index]
    stages = {state["stage"]: state for state in states}  # type: ignore[index]
    return {"elastic": {"steps": states[0]["steps"], "center": center, "stages": stages}}  # type: ignore[index]
