"""A user's script run by torchrun's elastic agent (``--nnodes=1:2``) on each of two "nodes":

    python -m torch.distributed.run --nnodes=1:2 --nproc-per-node=2 --max-restarts=1 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT train_elastic.py OUT STAGES STEPS EVERY KILL_AT [WHERE [START]]

``PipelineStrategy(stages=STAGES, elastic=True)`` with ``ModelCheckpoint(every_n_train_steps=EVERY)``, fitting
from ``ckpt_path=START`` where given (on every start, as a fine-tuning script would). On the first start with
the whole world (4 processes), global rank 0 writes ``OUT/kill`` once KILL_AT steps are done (WHERE ``step``, the
default) or inside the save of step KILL_AT (WHERE ``save``: while the checkpoint is being written), and waits
for ``OUT/killed`` (the test kills the other node in between). Every start writes each rank's weights, the
elastic report and the losses it saw to ``OUT/final-rank<r>-start<k>.pt``.

Each process prints ``elastic-test <unix time> rank <r> start <k>: <event>`` lines (imports done, training
started, fit done), a timeline of the run for the test's output."""

import os
import sys
import time
import traceback
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_pipe import PipelineStrategy
from lightning_pipe.trainer.launch.restarts import ElasticState
from tests.models import TinyNet, loader, trainer_kwargs

RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def stamp(event: str) -> None:
    print(f"elastic-test {time.time():.3f} rank {os.environ.get('RANK')} start {RESTART}: {event}", flush=True)


class KillAt(L.Callback):
    """Rank 0 of the first start says when ``at`` steps are done (or the save of step ``at`` started), and waits
    until the test killed a node."""

    def __init__(self, out: Path, at: int, where: str) -> None:
        self.out, self.at, self.where = out, at, where

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if self.where == "step":
            self._kill(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, *args: object) -> None:
        if self.where == "save":
            self._kill(trainer)

    def _kill(self, trainer: L.Trainer) -> None:
        if RESTART == 0 and trainer.world_size == 4 and trainer.is_global_zero and trainer.global_step == self.at:
            (self.out / "kill").write_text(str(self.at))
            deadline = time.monotonic() + 120
            while not (self.out / "killed").exists() and time.monotonic() < deadline:
                time.sleep(0.1)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    def on_train_start(self, trainer: L.Trainer, *args: object) -> None:
        stamp(f"training from step {trainer.global_step}")

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: dict, *args: object) -> None:
        self.losses.append((trainer.global_step, float(outputs["loss"])))


def main() -> None:
    stamp("imported")
    torch.set_num_threads(1)
    out, stages, steps, every, kill_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *map(int, sys.argv[4:6])
    where, start = (sys.argv[6:] + ["step", ""])[:2]
    torch.manual_seed(0)
    model = TinyNet()
    nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])  # the world of this start
    saves = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=every, save_top_k=-1)
    losses = Losses()
    trainer = L.Trainer(
        strategy=PipelineStrategy(stages=stages, chunks=2, elastic=True),
        accelerator="cpu",
        devices=2,
        num_nodes=nodes,
        callbacks=[KillAt(out, kill_at, where), losses, saves],
        **trainer_kwargs(max_steps=steps, enable_checkpointing=True, logger=CSVLogger(out, name="logs", version=0)),
    )
    trainer.fit(model, loader(n=48, batch_size=12), ckpt_path=start or None)
    stamp(f"fit done at step {trainer.global_step}")
    report = next(c.report for c in trainer.callbacks if isinstance(c, ElasticState))
    strategy = trainer.strategy
    torch.save(
        {
            "state_dict": model.state_dict(),
            "report": report,
            "layout": (strategy.num_stages, strategy.num_replicas, strategy.stage, strategy.replica),
            "accumulate": trainer.accumulate_grad_batches,
            "losses": losses.losses,
        },
        out / f"final-rank{trainer.global_rank}-start{RESTART}.pt",
    )


if __name__ == "__main__":
    code = 0
    try:
        main()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Nothing is left to do: skip Python's teardown of torch's and Lightning's modules (about 2 s on a loaded 2-core
    # machine), which would delay the agent's restart after a failure and its end after the last start.
    os._exit(code)
