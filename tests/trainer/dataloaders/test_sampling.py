"""Which samplers need the first stage's order shared (the sharing itself runs in tests/trainer/test_faults.py)."""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightning_pipe.trainer.dataloaders.sampling import is_deterministic, share_order
from tests.models import TinyNet, dataset, fit_plain
from tests.pipeline import assert_same_weights, fit_pipeline, twins


def test_only_samplers_free_of_process_randomness_count_as_deterministic() -> None:
    data = dataset()
    assert is_deterministic(SequentialSampler(data))
    assert is_deterministic(BatchSampler(SequentialSampler(data), 4, False))
    assert is_deterministic(DistributedSampler(data, num_replicas=2, rank=0, shuffle=True))
    assert is_deterministic(range(10))
    for sampler in (RandomSampler(data), WeightedRandomSampler(torch.ones(8), 8), SubsetRandomSampler(range(8))):
        assert not is_deterministic(sampler)
        assert not is_deterministic(BatchSampler(sampler, 4, False))


def test_loaders_that_cannot_drift_are_left_as_they_are() -> None:
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    sequential = DataLoader(dataset(), batch_size=4)
    before = sequential.batch_sampler
    assert share_order(sequential, None, 0, [0, 1]) is sequential and sequential.batch_sampler is before
    stream = DataLoader(Stream(), batch_size=2)
    assert share_order(stream, None, 0, [0, 1]) is stream
    shuffled = DataLoader(dataset(), batch_size=4, shuffle=True)
    sampler = shuffled.batch_sampler
    assert share_order(shuffled, None, 0, [0]) is shuffled and shuffled.batch_sampler is sampler  # one stage


class OwnBatches(BatchSampler):
    """A batch sampler that does not call ``BatchSampler.__init__`` (so it has no ``sampler``), as users write them."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.n).tolist()  # from the process's random state: the first stage's is shared
        for i in range(0, self.n, self.size):
            yield order[i : i + self.size]

    def __len__(self) -> int:
        return -(-self.n // self.size)


def test_a_batch_sampler_without_its_base_init_trains_as_in_plain_lightning() -> None:
    """Such a sampler counts as drawing at random (its order is the first stage's, sent to the others), and the
    pipeline trains as one process does on the same batches (not an ``AttributeError`` for its missing ``sampler``)."""
    assert not is_deterministic(OwnBatches(8, 4))
    torch.manual_seed(0)
    piped, plain = twins(TinyNet())
    L.seed_everything(1)  # as a user seeds a run (it sets PL_GLOBAL_SEED, which every process reads)
    fit_pipeline(piped, 2, DataLoader(dataset(), batch_sampler=OwnBatches(64, 12)), chunks=2, max_steps=4)
    L.seed_everything(1)  # the first stage draws as the one process draws: the same batches
    fit_plain(plain, DataLoader(dataset(), batch_sampler=OwnBatches(64, 12)), max_steps=4)
    assert_same_weights(plain, piped)
