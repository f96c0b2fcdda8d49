"""The layout an elastic run restarts with when its world changed (pure: numbers in, numbers out).

After a node is lost, torchrun's agent restarts the surviving processes with a smaller world. The
run keeps the user's pipeline depth where it still divides the new world; otherwise it takes the
smallest depth that divides it and is at least the user's (no process holds more layers than
before), or, where the world is smaller than the depth, one stage per process. The global batch
(DataLoader batch x replicas x gradient accumulation) is kept by accumulating more batches per
step on fewer replicas, where that is a whole number and the schedule accumulates (the
asynchronous ones apply one batch per optimizer step). Elastic averaging left with one replica
has nothing to average: the restart trains as one pipeline. What no restart could run (Chimera
on an odd world) is refused at the first start.
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


def restart_accumulation(
    accumulate: int, replicas: int, new_replicas: int, schedule: str, accumulates: bool = True
) -> tuple[int | None, str | None]:
    """The gradient accumulation on ``new_replicas`` that keeps the global batch of ``replicas``
    replicas accumulating ``accumulate`` batches each, or None and why none does (then each replica
    keeps its batch and the global batch changes). ``accumulates``: whether ``schedule`` accepts
    ``accumulate_grad_batches`` above 1 (the asynchronous schedules do not)."""
    kept = kept_accumulation(accumulate, replicas, new_replicas)
    if kept is None:
        return None, (
            f"{replicas} replicas x {accumulate} batches are not a whole number of batches for each of "
            f"{new_replicas} replicas"
        )
    if kept != 1 and not accumulates:
        return None, (
            f"schedule={schedule!r} applies one batch per optimizer step (accumulate_grad_batches=1), so "
            f"{new_replicas} replicas cannot accumulate the batches of {replicas}"
        )
    return kept, None


def restart_replicas_sync(replicas_sync: str, replicas: int, restarted: bool) -> str:
    """How the replicas keep together after a restart: elastic averaging (``"elastic"``) left with one
    replica of each stage has nothing to average, so a restarted run trains on as one pipeline
    (``"allreduce"`` over one replica: no collective). A first start with one replica stays refused."""
    return "allreduce" if replicas_sync == "elastic" and replicas == 1 and restarted else replicas_sync


def lost_node_problem(schedule: str, even_stages: bool, per_node: int) -> str | None:
    """Why a lost node would leave a world that no restart of ``schedule`` can run (None: every
    world of whole nodes runs). ``even_stages``: the schedule runs on an even number of processes
    only (Chimera); with an odd ``per_node``, a run of 2 nodes that loses one is left with an odd
    world, as is any run whose count of nodes left is odd."""
    if not even_stages or per_node % 2 == 0:
        return None
    return (
        f"schedule={schedule!r} runs on an even number of processes only (process i holds the stages of "
        f"process p-1-i), and with {per_node} processes per node a lost node can leave an odd number of "
        f"processes ({per_node} of {2 * per_node} with 2 nodes), on which every restart would be refused. "
        "Run an even number of processes per node (devices=2, 4, ...), or a schedule that runs on any number "
        "of processes ('1f1b', 'zero_bubble', 'interleaved_1f1b'), or elastic=False"
    )


def rescaled_count(count: int, replicas: int, new_replicas: int) -> int:
    """A count of one replica's batches in an epoch (samples read: count x batch x ``replicas``) in
    batches of ``new_replicas`` replicas reading the same samples (rounded down)."""
    return count * replicas // new_replicas
