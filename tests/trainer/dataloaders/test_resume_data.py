"""The training DataLoader's position as a checkpoint keeps it, under data-parallel replicas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.utils.data import DataLoader

from lightning_pipe.trainer.dataloaders.resume_data import training_loader
from tests.models import dataset


def _trainer(processed: int, state: dict | None = None) -> SimpleNamespace:
    """What the data hooks read of a Trainer whose running epoch has trained ``processed`` batches (resuming
    from a checkpoint whose loader ``state`` it holds, where given)."""
    resuming = state is not None
    batches = SimpleNamespace(current=SimpleNamespace(processed=processed), is_last_batch=False)
    fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=batches), is_resuming=resuming,
                               epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=0)),
                               _combined_loader_states_to_load=[state] if state else [])  # fmt: skip
    return SimpleNamespace(fit_loop=fit_loop)


def _replica_batches(replicas: int, batch: int, trainer: SimpleNamespace, state: dict | None = None) -> list:
    """Each replica's batches of the epoch (as lists of sample indices), the loader resumed from ``state``."""
    out = []
    for replica in range(replicas):
        loader = training_loader(DataLoader(dataset(48), batch_size=batch, shuffle=True), trainer, replicas, replica)
        if state is not None:
            loader.load_state_dict(state)
        out.append([list(b) for b in loader.batch_sampler])  # type: ignore[union-attr]
    return out


@pytest.mark.parametrize("replicas", [2, 3])
def test_the_saved_position_counts_every_replicas_samples_and_a_resume_reads_on(replicas: int) -> None:
    """After 2 steps of ``replicas`` x 4 samples, each replica's loader saves the global samples read (all
    replicas' together: 2 x replicas x 4), and the loaders resumed from that state read the batches an
    uninterrupted epoch reads from its third step on, replica by replica."""
    batch = 4
    states = [
        training_loader(DataLoader(dataset(48), batch_size=batch, shuffle=True), _trainer(2), replicas, r).state_dict()
        for r in range(replicas)
    ]
    assert all(s == states[0] for s in states) and states[0]["samples"] == 2 * replicas * batch
    uninterrupted = _replica_batches(replicas, batch, _trainer(0))
    resumed = _replica_batches(replicas, batch, _trainer(2, states[0]), states[0])
    assert resumed == [batches[2:] for batches in uninterrupted]
    assert len(uninterrupted[0]) == 48 // (replicas * batch)
