"""``PipelineStrategy(elastic=...)``: a run that torchrun's elastic agent restarts resumes by itself.

When a node is lost, the surviving ranks fail on communication, their agents stop them, meet again
(rendezvous) with the nodes that are left, and start the script again with a smaller world
(``TORCHELASTIC_RESTART_COUNT`` counts the restarts). With ``elastic`` on, each (re)start of
``fit``:

- resumes from the newest complete checkpoint of the watched folder (every file of one save,
  every checksum compared: :func:`~lightning_pipe.checkpoint.newest.newest_complete`), read under
  the layout that fits the new world (:func:`~lightning_pipe.plan.restart_layout.elastic_stages`; the
  checkpoint reshards on load, as any resume under another layout). A ``ckpt_path`` given to
  ``fit`` is taken until the folder holds a later save (:func:`~lightning_pipe.checkpoint.newest.saved_at`);
- keeps the global batch: ``k`` fewer replicas accumulate proportionally more batches per step
  (:func:`~lightning_pipe.plan.restart_layout.restart_accumulation`), and the epoch's batch counts are
  rescaled to the new replicas' batches, so the samples of each step are those of the run before;
  where the accumulation would not be a whole number, or the schedule does not accumulate (the
  asynchronous ones), each replica keeps its batch and the report says that the global batch
  changed, and why. A restart before the first checkpoint starts again from step 0 with the
  layout of the start before (kept in the progress file below), keeping its global batch too;
- says what happened, on global rank 0 and to the Trainer's loggers: the restart count, the
  nodes lost (by host and agent process), the old and new layout, the step resumed from, the
  steps done again and the seconds lost since the checkpoint;
- refuses, at the first start, a run that no restart after a lost node could run
  (:func:`~lightning_pipe.plan.restart_layout.lost_node_problem`), and marks what fails in a restart as
  coming from the restart (a note on the exception).

What the next start needs is kept with each checkpoint (the callback state of
:class:`ElasticState`) and, for the layout and the steps reached before a failure, in a small file
that global rank 0 rewrites when training starts and after every step
(``.lightning-pipe-elastic.json`` in the watched folder).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_pipe.checkpoint.newest import newest_complete, saved_at
from lightning_pipe.config import PipelineConfig
from lightning_pipe.partition.solvers.rank_order import check_rank_order
from lightning_pipe.plan.restart_layout import (
    elastic_stages,
    lost_node_problem,
    rescaled_count,
    restart_accumulation,
    restart_replicas_sync,
)
from lightning_pipe.runtime.topology import Layout
from lightning_pipe.schedules import traits
from lightning_pipe.trainer.dataloaders.resume_data import regroup_orders
from lightning_pipe.trainer.launch import run_identity

log = logging.getLogger(__name__)

PROGRESS = ".lightning-pipe-elastic.json"
_RAISED_IN = "lightning-pipe elastic: raised in"
Setting = bool | str | Path


def restart_count() -> int:
    """How many times torchrun's elastic agent restarted the run's processes (0: the first start, or
    no agent)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def _run_id() -> str | None:
    """torchrun's ``--rdzv-id``, the same for every start of one run (None without an agent)."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def layout(world: int, config: PipelineConfig) -> Layout:
    """The run's stages x replicas: ``config.stages`` or, with ``elastic``, the depth that fits ``world``;
    placed by ``config.rank_order`` where given (an elastic run restarted on another world places its
    ranks by their speed instead, as without it)."""
    found = Layout.of(world, elastic_stages(world, config.stages) if config.elastic is not False else config.stages)
    order = config.rank_order
    if order is None or (config.elastic is not False and len(order) != world):
        return found
    check_rank_order(order, world)
    return found.placed(order)


def watched_folder(trainer: pl.Trainer, setting: Setting) -> Path:
    """The folder whose checkpoints a restart resumes from: ``setting`` itself, or for ``True`` the
    first ``ModelCheckpoint``'s ``dirpath`` (which must be given: Lightning's default folder moves
    to a new logger version on every start)."""
    if not isinstance(setting, bool):
        return Path(setting)
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            return Path(callback.dirpath)
    raise ValueError(
        "PipelineStrategy(elastic=True) resumes from the checkpoints of ModelCheckpoint(dirpath=...), but no "
        "ModelCheckpoint callback has a dirpath (the default folder changes with each start's logger version). Add "
        "ModelCheckpoint(dirpath=FOLDER, every_n_train_steps=N, save_top_k=...) to the Trainer's callbacks, or give "
        "the folder: PipelineStrategy(elastic=FOLDER)."
    )


def resumer(setting: Setting) -> Callable[..., tuple[tuple, dict]] | None:
    """What the launchers call with ``(trainer, function, args, kwargs)`` before they run ``fit``
    (None when ``elastic`` is off): see :func:`resume_arguments`."""
    if setting is False:
        return None
    return lambda trainer, function, args, kwargs: resume_arguments(trainer, function, args, kwargs, setting)


def resume_arguments(
    trainer: pl.Trainer, function: Callable, args: tuple, kwargs: dict, setting: Setting
) -> tuple[tuple, dict]:
    """``fit``'s arguments with ``ckpt_path`` set to the newest complete checkpoint of the watched
    folder where the user gave none or an older one, and an :class:`ElasticState` first among the
    Trainer's callbacks (before ``ModelCheckpoint``: each step's progress is written before its save).

    Each process looks for itself (before the process group exists): nothing writes to the folder
    while an elastic agent restarts the run, so all find the same one (checked in
    :meth:`ElasticState.setup`). A run that a lost node would leave on a world no restart can run
    is refused here, at its first start."""
    if trainer.state.fn != TrainerFn.FITTING:
        return args, kwargs
    try:
        return _resume_arguments(trainer, function, args, kwargs, setting)
    except Exception as error:
        _note_restart(error)
        raise


def _resume_arguments(
    trainer: pl.Trainer, function: Callable, args: tuple, kwargs: dict, setting: Setting
) -> tuple[tuple, dict]:
    config: PipelineConfig = trainer.strategy.config  # type: ignore[attr-defined]  # PipelineStrategy's
    problem = lost_node_problem(config.schedule, traits(config.schedule).even_stages, trainer.num_devices)
    if problem is not None:
        raise MisconfigurationException(f"lightning-pipe elastic: {problem}.")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("RANK") == "0":
        log.warning(
            "lightning-pipe elastic: torchrun's agent shares its rendezvous store with the processes, and a restart "
            "then finds the addresses of the processes before it there (gloo: 'Connection refused' while connecting). "
            "Start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (see docs/elastic.md)."
        )
    folder = watched_folder(trainer, setting)
    bound = inspect.signature(function).bind(*args, **kwargs)
    model = bound.arguments.get("model")
    identity = run_identity.fingerprint(model) if model is not None else None
    found = None
    if "ckpt_path" in inspect.signature(function).parameters:
        given = bound.arguments.get("ckpt_path")
        after = saved_at(given) if given is not None else None
        if given is None or after is not None:  # a given path whose save cannot be read ("last") stays
            found = newest_complete(folder, after)
        if found is not None:
            if given is not None and os.environ.get("RANK", "0") == "0":
                log.warning(
                    "lightning-pipe elastic: resuming from %s (step %d) of the watched folder, newer than the given "
                    "ckpt_path %s.", found.path, found.step, given,
                )  # fmt: skip
            said = run_identity.check(found.path, found.step, folder, identity, restart_count() == 0)
            if said is not None and os.environ.get("RANK", "0") == "0":
                log.warning(said)
            bound.arguments["ckpt_path"] = str(found.path)
    for refused in found.refused if found is not None else ():
        log.warning("lightning-pipe elastic: passed over %s", refused)
    resumed = bound.arguments.get("ckpt_path")
    accumulates = not traits(config.schedule).asynchronous
    state = ElasticState(folder, str(resumed) if resumed is not None else None, config.schedule, accumulates,
                         config.replicas_sync, run_identity.record(identity))  # fmt: skip
    callbacks = [c for c in trainer.callbacks if not isinstance(c, ElasticState)]  # type: ignore[attr-defined]
    trainer.callbacks = [state, *callbacks]  # type: ignore[attr-defined]  # the Trainer's list (no property stub)
    return bound.args, bound.kwargs


def _note_restart(error: BaseException) -> None:
    """Mark ``error`` as raised in a start that torchrun's agent restarted (once; none on a first start)."""
    count, notes = restart_count(), getattr(error, "__notes__", [])
    if count > 0 and hasattr(error, "add_note") and not any(n.startswith(_RAISED_IN) for n in notes):
        world = os.environ.get("WORLD_SIZE", "?")
        error.add_note(
            f"{_RAISED_IN} restart {count} of the run (torchrun's elastic agent started it again on {world} "
            "processes, after a lost node or a failed process; the restart chooses its layout, checkpoint and "
            "accumulation for that world: docs/elastic.md)."
        )


def _nodes(rank: int) -> list[list[Any]]:
    """Every node of the world as ``[host, agent pid, ranks]`` (the agent: each process's parent)."""
    mine = (socket.gethostname(), os.getppid(), rank)
    gathered: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    nodes: dict[tuple[str, int], list[int]] = {}
    for host, pid, r in gathered:
        nodes.setdefault((host, pid), []).append(r)
    return [[host, pid, sorted(ranks)] for (host, pid), ranks in nodes.items()]


def describe_nodes(nodes: list[list[Any]]) -> str:
    return "; ".join(f"{host} (agent pid {pid}: ranks {', '.join(map(str, ranks))})" for host, pid, ranks in nodes)


def layout_text(stages: int, replicas: int, accumulate: int) -> str:
    return f"{stages} stages x {replicas} replicas, accumulating {accumulate}"


class ElasticState(Callback):
    """What an elastic restart needs from the run before it (kept with each checkpoint, and in the
    progress file), and what this start did about it (``report``, on every rank, once training
    starts; None on a start that resumes nothing).

    Args:
        folder: the watched folder (the progress file is written there).
        resumed: the checkpoint this start resumes from (None: none).
        schedule: the run's schedule, and ``accumulates``: whether it accepts gradient accumulation.
        replicas_sync: the ``replicas_sync`` the run was given.
        run: this run's record, kept with each checkpoint (:func:`.run_identity.record`)."""

    def __init__(
        self,
        folder: Path,
        resumed: str | None,
        schedule: str = "1f1b",
        accumulates: bool = True,
        replicas_sync: str = "allreduce",
        run: dict[str, Any] | None = None,
    ) -> None:
        self.folder = folder
        self.resumed = resumed
        self.schedule = schedule
        self.accumulates = accumulates
        self.replicas_sync = replicas_sync
        self.run = run
        self.previous: dict[str, Any] | None = None
        self.report: dict[str, Any] | None = None
        self._progress: dict[str, Any] | None = None
        self._started = 0.0
        self._trainer: pl.Trainer | None = None
        self._nodes: list[list[Any]] = []
        #: the replicas whose batches each update keeps (the first start's: see ReplicaOrder.regroup)
        self._grouping: int | None = None

    @property
    def state_key(self) -> str:
        return run_identity.STATE_KEY

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Every rank takes rank 0's progress file (read before rank 0 rewrites it) and checks that it
        found the same checkpoint."""
        self._trainer = trainer
        self._nodes = _nodes(trainer.global_rank)
        progress = _read_progress(self.folder) if trainer.is_global_zero else None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            chosen: list[Any] = [self.resumed, progress]
            dist.broadcast_object_list(chosen, 0)
            progress = chosen[1]
            if chosen[0] != self.resumed:
                raise RuntimeError(
                    f"lightning-pipe elastic: rank {trainer.global_rank} found the checkpoint {self.resumed} to resume "
                    f"from, rank 0 found {chosen[0]}: the processes do not see the same files in {self.folder}. Give "
                    "every node the same folder (a shared file system), or resume with fit(ckpt_path=...)."
                )
        self._progress = progress

    def _layout(self) -> tuple[int, int, int]:
        assert self._trainer is not None
        layout = self._trainer.strategy.layout  # type: ignore[attr-defined]  # PipelineStrategy's
        return layout.stages, layout.replicas, self._trainer.accumulate_grad_batches

    def state_dict(self) -> dict[str, Any]:
        if self._trainer is None:
            return {}
        stages, replicas, accumulate = self._layout()
        return {"stages": stages, "replicas": replicas, "accumulate": accumulate, "nodes": self._nodes,
                "grouping": self._grouping or replicas, "saved_at": time.time(), "run": self.run}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous = dict(state_dict) or None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep the global batch of the start before and say what changed (resuming a checkpoint, or,
        in a restart before the first checkpoint, from the layout in the progress file); then
        record this start's layout in the progress file."""
        self._started = now = time.time()
        progress, restarted = self._progress, restart_count() > 0
        previous, saved = self._start_before()
        if previous is None:
            self._grouping = self._layout()[1]
            self._write_progress(trainer)
            return
        stages, replicas, accumulate = self._layout()
        old_replicas = int(previous.get("replicas", replicas))  # unknown (a checkpoint of a run without elastic):
        old_accumulate = int(previous.get("accumulate", accumulate))  # taken as this start's
        kept, why = restart_accumulation(old_accumulate, old_replicas, replicas, self.schedule, self.accumulates)
        self._grouping = replicas
        if kept is not None:
            trainer.accumulate_grad_batches = accumulate = kept
            # the global batch is kept: so is each update, read in the first start's batches (token means)
            self._grouping = int(previous.get("grouping", old_replicas))
            if self._grouping != replicas:
                regroup_orders(trainer.train_dataloader, self._grouping, accumulate)
        if old_replicas != replicas and saved:  # the checkpoint's batch counts, in its replicas' batches
            _rescale_epoch_progress(trainer, old_replicas, replicas)
        notes = [why] if why is not None else []
        if restart_replicas_sync(self.replicas_sync, replicas, restarted) != self.replicas_sync:
            notes.append(
                f"replicas_sync={self.replicas_sync!r} is off: {replicas} replica of each stage is left, nothing to "
                "average, and it trains on as one pipeline from replica 0's weights (the checkpoint's)"
            )
        step = trainer.global_step
        reached = int(progress["step"]) if progress is not None else None
        since = previous.get("saved_at" if saved else "started")
        lost = [n for n in previous.get("nodes", []) if (n[0], n[1]) not in {(m[0], m[1]) for m in self._nodes}]
        self.report = {
            "restart": restart_count(),
            "checkpoint": self.resumed,
            "resumed_step": step,
            "steps_redone": max(reached - step, 0) if reached is not None else None,
            "seconds_lost": now - float(since) if since is not None else None,
            "seconds_down": now - float(progress["time"]) if progress is not None else None,
            "lost_nodes": lost,
            "old_layout": [previous.get("stages"), old_replicas, old_accumulate],
            "new_layout": [stages, replicas, accumulate],
            "global_batch_kept": kept is not None,
            "notes": notes,
        }
        if trainer.is_global_zero:
            _announce(trainer, self.report)
        self._write_progress(trainer)

    def _start_before(self) -> tuple[dict[str, Any] | None, bool]:
        """The layout and nodes this start continues, and whether they came with the checkpoint: the
        resumed checkpoint's where it has them; else the progress file's where this run's start
        before wrote it (a restart by the same torchrun run: lost before a checkpoint with them);
        else nothing known of a resumed checkpoint (``{}``), and None where nothing is resumed."""
        progress = self._progress
        if self.resumed is not None and self.previous:
            return self.previous, True
        if restart_count() > 0 and progress is not None and progress.get("run") == _run_id() and "replicas" in progress:
            return progress, False
        return ({} if self.resumed is not None else None), False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._write_progress(trainer)  # the step reached, for the steps a restart does again

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        _note_restart(exception)

    def _write_progress(self, trainer: pl.Trainer) -> None:
        """Global rank 0 records this start's layout and the step reached (written whole, then renamed)."""
        if not trainer.is_global_zero:
            return
        stages, replicas, accumulate = self._layout()
        progress = {"run": _run_id(), "step": trainer.global_step, "time": time.time(), "started": self._started,
                    "stages": stages, "replicas": replicas, "accumulate": accumulate, "nodes": self._nodes,
                    "grouping": self._grouping or replicas}  # fmt: skip
        self.folder.mkdir(parents=True, exist_ok=True)
        part = self.folder / f"{PROGRESS}.partial"
        part.write_text(json.dumps(progress))
        part.replace(self.folder / PROGRESS)


def _read_progress(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / PROGRESS).read_text())
    except (OSError, ValueError):
        return None


def _rescale_epoch_progress(trainer: pl.Trainer, replicas: int, new_replicas: int) -> None:
    """The epoch's batch counts, restored from a checkpoint of ``replicas`` replicas, in batches of
    ``new_replicas`` replicas reading the same samples (so that an epoch that ended at the save ends
    here too, and a resumed epoch counts the samples already read)."""
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    ready = rescaled_count(current.ready, replicas, new_replicas)
    current.completed = max(ready - (current.ready - current.completed), 0)
    current.processed = max(ready - (current.ready - current.processed), 0)  # type: ignore[attr-defined]
    current.started = max(ready - (current.ready - current.started), 0)  # type: ignore[attr-defined]
    current.ready = ready


def _announce(trainer: pl.Trainer, report: dict[str, Any]) -> None:
    """The report as one line on global rank 0 and as metrics to the Trainer's loggers."""
    old, new = report["old_layout"], report["new_layout"]
    lost = describe_nodes(report["lost_nodes"]) or "none"

    def number(value: float | None, unit: str = "") -> str:
        return "unknown" if value is None else f"{value:.1f}{unit}" if isinstance(value, float) else f"{value}{unit}"

    batch = "kept" if report["global_batch_kept"] else "NOT kept (each replica keeps its batch)"
    old_text = layout_text(*old) if old[0] is not None else "unknown"
    checkpoint = report["checkpoint"]
    source = f"({checkpoint})" if checkpoint is not None else "(no checkpoint yet: the run starts again)"
    since = "the checkpoint" if checkpoint is not None else "the start before began training"
    line = (
        f"lightning-pipe elastic: restart {report['restart']}: lost {lost}; layout {old_text} -> "
        f"{layout_text(*new)}; resumed from step {report['resumed_step']} {source}; "
        f"{number(report['steps_redone'])} steps to do again; {number(report['seconds_lost'], ' s')} lost since "
        f"{since} ({number(report['seconds_down'], ' s')} since the last step); global batch {batch}"
    ) + "".join(f"; {note}" for note in report["notes"])
    log.warning(line)
    metrics = {
        "elastic/restart": report["restart"],
        "elastic/resumed_step": report["resumed_step"],
        "elastic/world_size": new[0] * new[1],
        "elastic/lost_ranks": sum(len(n[2]) for n in report["lost_nodes"]),
    }
    for key in ("steps_redone", "seconds_lost", "seconds_down"):
        if report[key] is not None:
            metrics[f"elastic/{key}"] = report[key]
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
