"""SIGTERM under a pipeline: every process stops at the same step, or ends within a few seconds.

Lightning's SIGTERM handler runs a collective (``dist.broadcast`` on the default group) inside the
signal handler, that is at whatever point each process happens to be when its signal arrives, and
its training loop runs another broadcast at the start of every batch. Under data parallelism every
process is at the same point anyway; in a pipeline they are not: rank 0's handler broadcast, sent
from the middle of its step, is taken by rank 1 as the per-batch broadcast (value 1), so rank 1
enters the barrier that precedes Lightning's ``SIGTERMException`` while rank 0 waits in the
schedule for rank 1's activations, and both wait for ever. A process blocked in such a collective
never runs a Python handler again, so further SIGTERMs are ignored too.

Here the handler runs no collective. It records the request, passes the signal on to the processes
this one launched (as Lightning does), and starts a deadline. The stages agree on stopping at a
point every stage reaches: the start of each step (training, validation, test, predict), where
rank 0's request is broadcast from rank 0 without waiting (over gloo, so never a GPU sync), and
read one step later: no stage waits for another at a step's start. There every stage raises
Lightning's ``SIGTERMException`` together and
the Trainer ends the run as usual (``on_exception`` callbacks, loggers, teardown). The exception carries
the exit status ``128 + SIGTERM`` (143, as a process ended by the signal reports; Lightning's own has
none, so a script stopped this way would exit with 0 and a scheduler would take it for a success), and
at teardown rank 0 prints one line saying where the run stopped and which checkpoint it last saved. A process that
has not reached that point ``GRACE_SECONDS`` after its signal (a peer died, or the signal reached
only a later stage) exits with status ``128 + SIGTERM``; a second SIGTERM ends it at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed import ProcessGroup

from lightning_pipe.trainer import internals

GRACE_SECONDS = 10.0
STAGES = {"train": "training", "sanity_check": "the sanity check", "validate": "validation", "test": "testing",
          "predict": "prediction"}  # fmt: skip
#: the exit status of a run stopped by SIGTERM: what a process ended by the signal reports
STOPPED_STATUS = 128 + int(signal.SIGTERM)


class PipelineSignalConnector(internals.signal_connector_class()):  # type: ignore[misc]
    """Lightning's signal handling with the SIGTERM path above; ``received_sigterm`` becomes true on
    every rank at once, when the stages stop together."""

    def __init__(self, trainer: pl.Trainer, grace: float = GRACE_SECONDS) -> None:
        super().__init__(trainer)
        self.grace = grace
        self.requested = False
        self._deadline: threading.Timer | None = None
        self._posted: tuple[Any, torch.Tensor] | None = None  # the last step's broadcast of rank 0's flag
        self._group: ProcessGroup | None = None

    def register_signal_handlers(self) -> None:
        self.requested = False
        super().register_signal_handlers()

    def on_sigterm(self, signum: Any, _: FrameType | None) -> None:
        rank = self.trainer.global_rank
        if self.requested:
            _exit_now(f"[rank: {rank}] A second SIGTERM: exiting now.", 128 + int(signum))
        self.requested = True
        _say(f"[rank: {rank}] Received SIGTERM: every stage stops at the start of the next step.")
        launcher = self.trainer.strategy.launcher
        if launcher is not None:
            launcher.kill(signum)
        self._deadline = threading.Timer(self.grace, self._expire, args=(int(signum),))
        self._deadline.daemon = True
        self._deadline.start()

    def _expire(self, signum: int) -> None:
        launcher = self.trainer.strategy.launcher
        if launcher is not None:
            launcher.kill(signal.SIGKILL)
        _exit_now(
            f"[rank: {self.trainer.global_rank}] Still running {self.grace:g} s after SIGTERM (the other stages did "
            "not stop with this one): exiting.",
            128 + signum,
        )

    def stop_if_requested(self) -> None:
        """At the start of a step, on every rank: raise ``SIGTERMException`` on all of them when rank 0
        had received SIGTERM by the start of the previous step. Rank 0's flag travels in a broadcast
        posted at each step's start and read at the next one, so no rank waits for it."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            if self.requested:
                self._stop()
            return
        if self._posted is not None:
            (work, flag), self._posted = self._posted, None
            work.wait()
            if flag.item():
                self._stop()
        if self._group is None:  # every rank gets here first at the same point: its first step
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        flag = torch.tensor([1 if self.requested else 0])
        self._posted = (dist.broadcast(flag, src=0, group=self._group, async_op=True), flag)

    def finish(self) -> None:
        """At the end of a run that ended normally, wait for the last step's flag broadcast: every
        rank posted as many, and a collective still in flight when the process exits can abort it
        (SIGABRT from gloo's threads at interpreter exit). After an exception it is dropped, as a
        peer that failed may never post its part."""
        posted, self._posted = self._posted, None
        if posted is not None and self.trainer.state.status != TrainerStatus.INTERRUPTED:
            posted[0].wait()

    def _stop(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self.received_sigterm = True
        raise SIGTERMException(STOPPED_STATUS)

    def teardown(self) -> None:
        """After the ``on_exception`` callbacks (a ``ModelCheckpoint(save_on_exception=True)`` has saved by
        then): rank 0 says where a run stopped by SIGTERM stopped and what it saved."""
        super().teardown()
        trainer = self.trainer
        if self.received_sigterm and trainer.global_rank == 0:
            stage = STAGES.get(trainer.state.stage.value if trainer.state.stage is not None else "", "the run")
            _say(stop_summary(stage, trainer.global_step, trainer.current_epoch, last_checkpoint(trainer)))

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_deadline"] = None
        state["_posted"] = None
        state["_group"] = None
        return state


def last_checkpoint(trainer: pl.Trainer) -> str | None:
    """The newest checkpoint file the Trainer's ``ModelCheckpoint`` callbacks have written (None: none)."""
    paths = [
        path
        for callback in trainer.checkpoint_callbacks
        for path in (getattr(callback, "last_model_path", ""), getattr(callback, "best_model_path", ""))
        if path and os.path.exists(path)  # a file, or a pipeline checkpoint's folder
    ]
    return max(paths, key=os.path.getmtime) if paths else None


def stop_summary(stage: str, step: int, epoch: int, checkpoint: str | None) -> str:
    """The one line a run stopped by SIGTERM ends with."""
    saved = (
        f"the last checkpoint saved is {checkpoint} (resume from it)"
        if checkpoint
        else "no checkpoint was saved (a ModelCheckpoint callback, or checkpoint=true on the command line, saves them)"
    )
    return (
        f"lightning-pipe: stopped by SIGTERM during {stage} after {step} steps (epoch {epoch}); {saved}; "
        f"exit status {STOPPED_STATUS}."
    )


def _say(message: str) -> None:
    """Straight to stderr: a signal handler may interrupt a ``print`` of the same stream."""
    os.write(sys.stderr.fileno(), (message + "\n").encode())


def _exit_now(message: str, status: int) -> None:
    _say(message)
    os._exit(status)


def install(trainer: pl.Trainer) -> PipelineSignalConnector:
    """Replace the Trainer's signal handling (before the Trainer registers its handlers, which it does
    after setting the strategy up)."""
    connector = internals.signal_connector(trainer)
    if not isinstance(connector, PipelineSignalConnector):
        connector = PipelineSignalConnector(trainer)
        internals.set_signal_connector(trainer, connector)
    return connector
