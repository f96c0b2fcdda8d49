"""Recomputation leaves a stage's buffers as the forward left them: in-process and under the Trainer."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe.runtime.activations.recomputation import keep_buffers
from tests.models import CLASSES, HIDDEN, TinyNet, fit_plain, loader
from tests.pipeline import assert_same_weights, fit_pipeline, twins

pytestmark = pytest.mark.timeout(180)


class CountsCalls(nn.Module):
    """Mutates a buffer in place in its forward, as a step counter or an EMA would."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("table", torch.ones(64, 64))  # read, never written
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x) * self.table[0, :4]


@pytest.mark.parametrize("early_stop", [True, False])
def test_a_buffer_mutated_in_place_counts_each_forward_once(early_stop: bool) -> None:
    module = nn.Sequential(CountsCalls(), nn.Tanh(), nn.BatchNorm1d(4))
    x = torch.randn(6, 4, requires_grad=True)
    with set_checkpoint_early_stop(early_stop):
        for _ in range(3):
            checkpoint(module, x, use_reentrant=False, context_fn=lambda: keep_buffers(module)).sum().backward()
    assert int(module[0].calls) == 3
    assert int(module[2].num_batches_tracked) == 3


def test_a_graph_that_was_not_recomputed_still_runs_its_backward_after_a_restore() -> None:
    """``except_last``: the last micro-batch's graph saved the running statistics; restoring them
    for an earlier micro-batch's recomputation must not make that backward refuse them."""
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(6, 4)
    first = checkpoint(module, x, use_reentrant=False, context_fn=lambda: keep_buffers(module))
    last = module(x + 1)  # not recomputed
    first.sum().backward()
    last.sum().backward()
    assert int(module[1].num_batches_tracked) == 2


def test_only_the_buffers_a_forward_changes_are_copied() -> None:
    module = nn.Sequential(CountsCalls(), nn.BatchNorm1d(4))
    forward, recomputation = keep_buffers(module)
    with forward:
        module(torch.randn(6, 4))
    kept = {id(b) for b in recomputation.changed}
    assert kept == {
        id(module[0].calls),
        id(module[1].running_mean),
        id(module[1].running_var),
        id(module[1].num_batches_tracked),
    }
    assert id(module[0].table) not in kept  # a large buffer no forward writes is not cloned per micro-batch


def _batch_norm_net() -> TinyNet:
    """TinyNet with a BatchNorm1d on each of two stages."""
    torch.manual_seed(0)
    model = TinyNet()
    model.layers.insert(1, nn.BatchNorm1d(HIDDEN))
    model.layers.insert(6, nn.BatchNorm1d(HIDDEN))
    return model


@pytest.mark.parametrize("schedule, mode", [("1f1b", "always"), ("gpipe", "always"), ("1f1b", "except_last")])
def test_recomputation_leaves_running_statistics_as_a_pipeline_without_it(schedule: str, mode: str) -> None:
    data = loader(n=60, batch_size=12)  # whole batches: no micro-batch of one sample
    never, recomputed = twins(_batch_norm_net())
    fit_pipeline(never, 2, data, schedule=schedule, chunks=3, recompute="never", max_steps=6)
    fit_pipeline(recomputed, 2, data, schedule=schedule, chunks=3, recompute=mode, max_steps=6)
    assert int(recomputed.layers[1].num_batches_tracked) == int(recomputed.layers[6].num_batches_tracked) == 6 * 3
    assert_same_weights(never, recomputed)  # parameters and buffers: running means, variances, counts
    if mode != "always":
        return

    plain, single = twins(_batch_norm_net())  # one micro-batch per batch: what plain training does
    fit_plain(plain, data, max_steps=6)
    fit_pipeline(single, 2, data, schedule=schedule, chunks=1, recompute="always", max_steps=6)
    assert int(single.layers[1].num_batches_tracked) == int(plain.layers[1].num_batches_tracked) == 6
    assert_same_weights(plain, single)


class TinyResNet(L.LightningModule):
    """A Hugging Face ResNet (BatchNorm2d after every convolution) laid out as a Sequential."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ResNetConfig, ResNetModel

        torch.manual_seed(0)
        resnet = ResNetModel(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"))
        self.layers = nn.Sequential(
            resnet.embedder, *resnet.encoder.stages, resnet.pooler, nn.Flatten(), nn.Linear(16, CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_a_hugging_face_resnet_counts_each_micro_batch_once_under_recomputation() -> None:
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    images = DataLoader(
        TensorDataset(torch.randn(48, 3, 16, 16, generator=g), torch.randint(0, CLASSES, (48,), generator=g)),
        batch_size=12,
    )
    never, always = twins(TinyResNet())
    fit_pipeline(never, 2, images, chunks=3, recompute="never", max_steps=4)
    fit_pipeline(always, 2, images, chunks=3, recompute="always", max_steps=4)
    counts = [int(b) for name, b in always.named_buffers() if name.endswith("num_batches_tracked")]
    assert len(counts) == 6 and set(counts) == {4 * 3}
    assert_same_weights(never, always)

    plain, single = twins(TinyResNet())
    fit_plain(plain, images, max_steps=4)
    fit_pipeline(single, 2, images, chunks=1, recompute="always", max_steps=4)
    assert_same_weights(plain, single)
