"""A user's script that trains until it is stopped: ``python until_terminated.py OUT``.

Each rank writes ``OUT/pid-RANK`` once training has started and ``OUT/stopped-RANK`` (the exception's
name) when the Trainer stops on an exception; a checkpoint is saved every 2 steps to ``OUT/checkpoints``."""

import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_pipe  # noqa: F401  (registers strategy="pipeline")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.models import TinyNet, loader, trainer_kwargs


class Record(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with open(os.path.join(self.out, f"pid-{trainer.global_rank}"), "w") as f:
            f.write(str(os.getpid()))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        with open(os.path.join(self.out, f"stopped-{trainer.global_rank}"), "w") as f:
            f.write(type(exception).__name__)


class Net(TinyNet):
    """Logs its validation loss per epoch without ``sync_dist``, as a user's model does."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    torch.manual_seed(0)
    trainer = L.Trainer(
        strategy="pipeline",
        accelerator="cpu",
        devices=2,
        callbacks=[Record(out), ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), every_n_train_steps=2)],
        **trainer_kwargs(
            max_steps=10**9,
            val_check_interval=4,
            limit_val_batches=2,
            check_val_every_n_epoch=None,
            enable_checkpointing=True,
        ),
    )
    trainer.fit(Net(), loader(), loader(n=24, seed=1))
