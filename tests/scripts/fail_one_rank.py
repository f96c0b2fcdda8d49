"""A user's script in which one rank fails: ``python fail_one_rank.py DEVICES RANK raise|kill``.
The rank raises an exception in training_step (or kills itself) at the third step."""

import os
import signal
import sys

import lightning as L
import torch

import lightning_pipe  # noqa: F401

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.models import TinyNet, loader, trainer_kwargs


class FailsOnOneRank(TinyNet):
    def __init__(self, rank: int, how: str) -> None:
        super().__init__()
        self.failing_rank, self.how = rank, how

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if batch_idx == 2 and self.trainer.global_rank == self.failing_rank:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"boom in the user's code on rank {self.failing_rank}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    devices, rank, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    trainer = L.Trainer(strategy="pipeline", accelerator="cpu", devices=devices, **trainer_kwargs(max_steps=20))
    trainer.fit(FailsOnOneRank(rank, how), loader())
