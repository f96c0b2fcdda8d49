"""How the data-parallel replicas split a DataLoader (the combined metrics run in
tests/test_data_parallel_lifecycle.py)."""

from __future__ import annotations

import pytest
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe.runtime.replica_data import EvaluationShare
from lightning_pipe.runtime.sampling import is_deterministic
from lightning_pipe.trainer.data import split_over_replicas
from tests.models import dataset


def test_evaluation_share_of_21_samples_in_batches_of_5_over_2_replicas() -> None:
    first, second = (EvaluationShare(21, 5, False, 2, replica) for replica in (0, 1))
    assert list(first) == [[0, 2, 4, 6, 8], [10, 12, 14, 16, 18], [20]]
    assert list(second) == [[1, 3, 5, 7, 9], [11, 13, 15, 17, 19], [1]]  # the last batch only keeps step
    assert len(first) == len(second) == 3
    assert [first.is_padding(i) for i in range(3)] == [False] * 3
    assert [second.is_padding(i) for i in range(3)] == [False, False, True]


@pytest.mark.parametrize("samples", [0, 1, 3, 20, 21, 23, 40])
@pytest.mark.parametrize("batch_size, replicas", [(5, 2), (5, 4), (1, 3), (8, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_and_the_replicas_in_step(
    samples: int, batch_size: int, replicas: int, drop_last: bool
) -> None:
    shares = [EvaluationShare(samples, batch_size, drop_last, replicas, r) for r in range(replicas)]
    steps = {len(share) for share in shares}
    assert len(steps) == 1 and all(len(list(share)) == len(share) for share in shares)  # the replicas step together
    real = [i for share in shares for k, batch in enumerate(share) if not share.is_padding(k) for i in batch]
    kept = samples - samples % batch_size if drop_last else samples  # what plain Lightning evaluates
    assert sorted(real) == list(range(kept))
    for share in shares:
        padding = [batch for k, batch in enumerate(share) if share.is_padding(k)]
        assert len(padding) <= 1 and all(len(batch) == 1 and 0 <= batch[0] < samples for batch in padding)
    assert all(any(not share.is_padding(k) for share in shares) for k in range(steps.pop()))  # no step without samples


def test_evaluation_loaders_get_a_share_and_training_loaders_a_distributed_sampler() -> None:
    user = DataLoader(dataset(21), batch_size=5)
    evaluation = split_over_replicas(user, 2, 1, RunningStage.VALIDATING)
    assert isinstance(evaluation.batch_sampler, EvaluationShare) and len(evaluation) == 3
    assert is_deterministic(evaluation.batch_sampler)  # the stages of a replica read it without sharing an order
    assert [len(x) for x, _ in evaluation] == [5, 5, 1]
    assert user.batch_sampler is not evaluation.batch_sampler and len(user) == 5  # the user's loader is unchanged
    training = split_over_replicas(user, 2, 1, RunningStage.TRAINING)
    assert isinstance(training.sampler, DistributedSampler) and len(training.sampler) == 11  # padded: 22 = 2 x 11
    custom = DataLoader(dataset(21), batch_sampler=[[0, 1], [2, 3, 4]])
    assert split_over_replicas(custom, 2, 1, RunningStage.TESTING) is custom  # read whole by every replica
    assert split_over_replicas(user, 1, 0, RunningStage.VALIDATING) is user
