"""Which samplers need the first stage's order shared (the sharing itself runs in tests/test_faults.py)."""

from __future__ import annotations

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
from tests.models import dataset


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
