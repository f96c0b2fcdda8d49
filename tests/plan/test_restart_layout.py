"""The layout an elastic restart chooses after a lost node (pure: numbers in, numbers out)."""

from __future__ import annotations

from lightning_pipe.plan.restart_layout import (
    elastic_stages,
    lost_node_problem,
    restart_accumulation,
    restart_replicas_sync,
)
from lightning_pipe.schedules import traits


def test_the_depth_kept_where_it_divides_the_world_else_the_smallest_deeper_one() -> None:
    assert [elastic_stages(world, 4) for world in (8, 6, 4, 2, 3)] == [4, 6, 4, 2, 3]
    assert elastic_stages(5, None) is None


def test_the_global_batch_is_kept_by_accumulating_where_the_schedule_accumulates() -> None:
    """2 replicas to 1 accumulate 2 batches; 3 to 2 cannot (whole batches); an asynchronous schedule applies
    one batch per step, so 2 to 1 keeps each replica's batch instead, and says why."""
    assert restart_accumulation(1, 2, 1, "1f1b") == (2, None)
    assert restart_accumulation(2, 1, 2, "1f1b") == (1, None)  # grown back
    assert restart_accumulation(1, 4, 2, "pipedream", accumulates=False)[0] is None
    kept, why = restart_accumulation(1, 3, 2, "1f1b")
    assert kept is None and why is not None and "3 replicas x 1 batches" in why
    kept, why = restart_accumulation(1, 2, 1, "pipedream", accumulates=not traits("pipedream").asynchronous)
    assert kept is None and why is not None and "schedule='pipedream' applies one batch per optimizer step" in why
    assert restart_accumulation(1, 2, 2, "pipedream", accumulates=False) == (1, None)  # the same world: nothing lost


def test_elastic_averaging_left_with_one_replica_trains_as_one_pipeline_only_on_a_restart() -> None:
    assert restart_replicas_sync("elastic", 1, restarted=True) == "allreduce"
    assert restart_replicas_sync("elastic", 1, restarted=False) == "elastic"  # a first start: refused later
    assert restart_replicas_sync("elastic", 2, restarted=True) == "elastic"
    assert restart_replicas_sync("allreduce", 1, restarted=True) == "allreduce"


def test_a_schedule_that_needs_an_even_world_is_refused_where_a_lost_node_leaves_an_odd_one() -> None:
    problem = lost_node_problem("chimera", traits("chimera").even_stages, per_node=3)
    assert problem is not None and "3 of 6" in problem and "even number of processes per node" in problem
    assert lost_node_problem("chimera", True, per_node=2) is None
    assert lost_node_problem("1f1b", traits("1f1b").even_stages, per_node=3) is None
