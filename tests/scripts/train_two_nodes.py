"""A user's script run by torchrun on each of two nodes (2 processes each):

    torchrun --nnodes 2 --node-rank K --nproc-per-node 2 --master-addr HOST --master-port PORT \\
        train_two_nodes.py OUT

Lightning's cluster environment (torchelastic) gives the ranks; the strategy lays out 2 stages x 2
replicas, the replicas of a stage on one node."""

import os
import sys

import lightning as L
import torch

from lightning_pipe import PipelineStrategy

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.models import TinyNet, loader, trainer_kwargs

if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    torch.manual_seed(0)
    model = TinyNet()
    strategy = PipelineStrategy(stages=2, chunks=3)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=2, **trainer_kwargs())
    trainer.fit(model, loader(batch_size=12))
    layout = {
        "rank": trainer.global_rank,
        "stage": strategy.stage,
        "replica": strategy.replica,
        "node": trainer.node_rank,
    }
    torch.save({"state_dict": model.state_dict(), "layout": layout}, os.path.join(out, f"rank{trainer.global_rank}.pt"))
