"""The benchmark workload every contender of ``compare.py`` trains (its own module, so that the
contenders' runners import it without importing ``compare.py`` back): the models, the stage count,
the module and the data."""

from __future__ import annotations

import os
import socket
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))

from step_time import MLP

MODELS = {
    "mlp": {
        "batch": 256,
        "chunks": 8,
        "features": (1024,),
        "classes": 10,
        "steps": 14,
        "warmup": 4,
        "paired_rounds": 8,
    },
    "vgg19": {
        "batch": 32,
        "chunks": 4,
        "features": (3, 32, 32),
        "classes": 100,
        "steps": 7,
        "warmup": 2,
        "paired_rounds": 0,
    },
}
STAGES = 2


def build_module(model: str) -> L.LightningModule:
    torch.manual_seed(0)
    if model == "mlp":
        return MLP(1024, 8)
    from lightning_pipe.recipes.vgg import VGGClassifier

    return VGGClassifier(depth=19, batch_norm=True, num_classes=100)


def data(model: str, batch: int, batches: int) -> DataLoader:
    spec = MODELS[model]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch * batches, *spec["features"], generator=g)
    y = torch.randint(0, spec["classes"], (batch * batches,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def free_port() -> int:
    """A free local TCP port for a contender's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
