"""How the data-parallel replicas split a DataLoader (the combined metrics run in
tests/runtime/replicas/test_data_parallel_lifecycle.py)."""

from __future__ import annotations

import pytest
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, WeightedRandomSampler

from lightning_pipe.trainer.dataloaders.loaders import split_over_replicas
from lightning_pipe.trainer.dataloaders.replica_data import EvaluationShare, ReplicaOrder, not_steered
from lightning_pipe.trainer.dataloaders.sampling import is_deterministic
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


# ---------------------------------------------------------------------------- the training order, resumable
@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_fresh_epoch_is_distributed_samplers_order(replicas: int, shuffle: bool) -> None:
    data = dataset(21)
    for rank in range(replicas):
        ours = ReplicaOrder(data, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=5)
        torchs: DistributedSampler[int] = DistributedSampler(data, replicas, rank, shuffle=shuffle, seed=5)
        ours.set_epoch(3)
        torchs.set_epoch(3)
        assert list(ours) == list(torchs) and len(ours) == len(torchs)


def _global_steps(replicas: int, batch: int, state: dict | None = None, epoch: int = 1) -> list[list[int]]:
    """The samples of each global step (every replica's batch of it), as sets in order of position."""
    orders = [ReplicaOrder(dataset(48), replicas, r, True, 7) for r in range(replicas)]
    for order in orders:  # in Lightning's order: the checkpoint's state, then the epoch
        if state is not None:
            assert order.resume(state) is None
        order.set_epoch(epoch)
    parts = [list(order) for order in orders]
    steps = len(parts[0]) // batch
    return [sorted(i for part in parts for i in part[s * batch : (s + 1) * batch]) for s in range(steps)]


@pytest.mark.parametrize("saved_replicas, replicas", [(2, 2), (2, 1), (1, 2), (3, 1), (1, 3)])
def test_a_resumed_epoch_reads_on_from_the_saved_position_under_any_replicas(
    saved_replicas: int, replicas: int
) -> None:
    """2 global steps of 12 samples done under ``saved_replicas``: the rest of the epoch, under ``replicas``
    (each step of 12 = replicas x batch), reads the samples an uninterrupted run reads, step by step."""
    whole = _global_steps(1, 12)  # the epoch's global order in steps of 12
    saved = ReplicaOrder(dataset(48), saved_replicas, 0, True, 7)
    saved.set_epoch(1)
    state = saved.position(2 * 12)
    assert state == {"epoch": 1, "seed": 7, "shuffle": True, "size": 48, "samples": 24, "complete": False}
    assert _global_steps(replicas, 12 // replicas, state) == whole[2:]
    assert _global_steps(replicas, 12 // replicas, state, epoch=2) == _global_steps(1, 12, epoch=2)  # a later epoch


def test_a_position_holds_for_its_dataset_only_and_set_epoch_reaches_the_users_sampler() -> None:
    epochs: list[int] = []

    class Epochs(RandomSampler):
        def set_epoch(self, epoch: int) -> None:
            epochs.append(epoch)

    order = ReplicaOrder(dataset(20), 1, 0, True, 0, replaced=Epochs(dataset(20)))
    order.set_epoch(4)
    assert epochs == [4]
    problem = order.resume({"epoch": 4, "seed": 0, "shuffle": True, "size": 30, "samples": 10})
    assert problem is not None and "30 samples" in problem and len(list(order)) == 20  # from the epoch's start


def test_which_loaders_the_pipeline_steers() -> None:
    data = dataset(20)
    assert not_steered(DataLoader(data, batch_size=4)) is None
    assert not_steered(DataLoader(data, batch_size=4, shuffle=True)) is None
    assert (
        not_steered(DataLoader(data, sampler=RandomSampler(data, replacement=True)))
        == "a custom sampler (RandomSampler)"
    )
    assert not_steered(DataLoader(data, batch_sampler=[[0, 1]])) == "a custom batch_sampler (list)"
    assert not_steered(DataLoader(data, sampler=WeightedRandomSampler([1.0] * 20, 20))) is not None


def test_a_resumed_epoch_keeps_its_saved_seed_and_the_next_epoch_takes_the_runs() -> None:
    """A run resumed under another seed finishes the saved epoch in its saved order (and saves that
    seed again), and draws the next epochs from its own seed."""
    saved = ReplicaOrder(dataset(20), 1, 0, True, 3)
    saved.set_epoch(2)
    other = ReplicaOrder(dataset(20), 1, 0, True, 4)
    assert other.resume(saved.position(8)) is None and other.epoch == 2  # drawn from at once (workers), as saved
    other.set_epoch(2)
    assert list(other) == list(saved)[8:] and other.position(12)["seed"] == 3
    other.set_epoch(3)
    assert list(other) == list(ReplicaOrder(dataset(20), 1, 0, True, 4, None).order(3, 4))
    assert other.position(0)["seed"] == 4


def test_a_saved_epoch_that_ended_resumes_at_the_next_one() -> None:
    """Before Lightning's ``set_epoch`` (a DataLoader with workers draws at once): the epoch after one
    that ended, with ``drop_last`` too (its samples read fall short of the dataset's)."""
    for state in ({"samples": 20, "complete": False}, {"samples": 16, "complete": True}):
        order = ReplicaOrder(dataset(20), 1, 0, True, 3)
        assert order.resume({"epoch": 4, "seed": 3, "shuffle": True, "size": 20, **state}) is None
        assert order.epoch == 5 and list(order) == order.order(5, 3)


@pytest.mark.parametrize("first, replicas, accumulate", [(2, 1, 2), (2, 1, 4), (4, 2, 2), (1, 2, 1)])
def test_a_restart_on_other_replicas_reads_each_update_in_the_first_starts_batches(
    first: int, replicas: int, accumulate: int
) -> None:
    """An elastic restart from ``first`` replicas (accumulating ``replicas x accumulate / first``) to
    ``replicas`` accumulating ``accumulate``: every update's batches hold the same samples as the first
    start's (equal-weight means of token means depend on them), an epoch's last part update included."""
    batch, size = 3, 60  # updates of replicas x accumulate x 3 samples; 60 leaves a part update for (2, 1, 4)
    first_accumulate = replicas * accumulate // first

    def batches(d: int, a: int, regroup: bool) -> list[list[frozenset[int]]]:
        """Each update's batches, as sets of samples (their order within an update does not count)."""
        reads = []
        for r in range(d):
            order = ReplicaOrder(dataset(size), d, r, True, 5)
            if regroup:
                order.regroup(first, a, batch)
            samples = list(order)
            reads.append([samples[i : i + batch] for i in range(0, len(samples), batch)])
        updates = -(-len(reads[0]) // a)
        return [
            sorted((frozenset(b) for read in reads for b in read[u * a : (u + 1) * a]), key=min) for u in range(updates)
        ]

    expected = batches(first, first_accumulate, False)
    assert batches(replicas, accumulate, True) == expected
    if first != replicas:  # without regrouping the batches differ (what made token means drift)
        assert batches(replicas, accumulate, False) != expected
