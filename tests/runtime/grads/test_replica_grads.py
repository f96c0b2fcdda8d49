"""How many gradient accumulations make a parameter's gradient final in a step (the overlapped
all-reduce over the replicas itself runs in tests/runtime/replicas/test_data_parallel.py)."""

from __future__ import annotations

import pytest

from lightning_pipe.runtime.grads.replica_grads import Accumulations

ONCE, TWICE, UNUSED, SOME = (
    1,
    2,
    3,
    4,
)  # parameter keys: used once / twice per micro-batch, never, in some micro-batches


def _first_step(microbatches: int) -> Accumulations:
    counts = Accumulations()
    counts.start(microbatches)
    assert not any(counts.final(key, 1, (3, 8)) for key in (ONCE, TWICE, SOME))  # nothing is known yet
    counts.learn({ONCE: microbatches, TWICE: 2 * microbatches, UNUSED: 0, SOME: microbatches - 1})
    return counts


def test_each_step_expects_its_own_micro_batch_count_times_the_uses() -> None:
    counts = _first_step(2)  # a short first batch: 2 micro-batches
    for microbatches in (3, 1, 4):
        counts.start(microbatches)
        assert counts.expected == {ONCE: microbatches, TWICE: 2 * microbatches, UNUSED: 0}
        assert [counts.final(ONCE, c, (3, 8)) for c in range(1, microbatches + 1)] == [False] * (microbatches - 1) + [
            True
        ]
        assert (
            counts.ready(UNUSED, 0) and counts.ready(TWICE, 2 * microbatches) and not counts.ready(TWICE, microbatches)
        )


def test_a_parameter_used_by_some_micro_batches_only_is_never_ready_early() -> None:
    counts = _first_step(3)
    counts.start(3)
    assert not any(counts.final(SOME, c, (3, 8)) for c in range(1, 7)) and not counts.ready(SOME, 2)


def test_more_uses_than_the_first_step_had_is_explained() -> None:
    counts = _first_step(2)
    counts.start(3)
    with pytest.raises(
        RuntimeError,
        match=r"shape \(3, 8\) received 4 gradient accumulations in a step of 3 micro-batches, where the first step "
        r"gave it 1 per micro-batch",
    ):
        counts.final(ONCE, 4, (3, 8))
    with pytest.raises(RuntimeError, match="multiply its result by zero"):
        counts.final(UNUSED, 1, (3, 8))
