"""The layout an elastic run restarts with when its world changed (pure: numbers in, numbers out).

After a node is lost, torchrun's agent restarts the surviving processes with a smaller world. The
run keeps the user's pipeline depth where it still divides the new world; otherwise it takes the
smallest depth that divides it and is at least the user's (no process holds more layers than
before), or, where the world is smaller than the depth, one stage per process. The global batch
(DataLoader batch x replicas x gradient accumulation) is kept by accumulating more batches per
step on fewer replicas, where that is a whole number.
"""

from __future__ import annotations


def elastic_stages(world: int, stages: int | None) -> int | None:
    """The pipeline depth for a world of ``world`` processes, given the user's ``stages``
    (None: one stage per process, whatever the world)."""
    if world < 1:
        raise ValueError(f"elastic_stages(world={world}): a world has at least one process.")
    if stages is None or world % stages == 0:
        return stages
    fitting = [depth for depth in range(stages, world + 1) if world % depth == 0]
    return fitting[0] if fitting else world


def kept_accumulation(accumulate: int, replicas: int, new_replicas: int) -> int | None:
    """Gradient accumulation on ``new_replicas`` that keeps the global batch of ``replicas``
    replicas accumulating ``accumulate`` batches each; None where it is not a whole number (then the
    per-replica batch is kept and the global batch changes)."""
    total = accumulate * replicas
    return total // new_replicas if total % new_replicas == 0 else None


def rescaled_count(count: int, replicas: int, new_replicas: int) -> int:
    """A count of one replica's batches in an epoch (samples read: count x batch x ``replicas``) in
    batches of ``new_replicas`` replicas reading the same samples (rounded down)."""
    return count * replicas // new_replicas


__all__ = ["elastic_stages", "kept_accumulation", "rescaled_count"]
