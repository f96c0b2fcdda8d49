"""``PipelineStrategy(elastic=...)``: a run that torchrun's elastic agent restarts resumes by itself.

When a node is lost, the surviving ranks fail on communication, their agents stop them, meet again
(rendezvous) with the nodes that are left, and start the script again with a smaller world
(``TORCHELASTIC_RESTART_COUNT`` counts the restarts). With ``elastic`` on, each (re)start of
``fit`` without a ``ckpt_path``:

- resumes from the newest complete checkpoint of the watched folder (every file of one save,
  every checksum compared: :func:`~lightning_pipe.checkpoint.newest.newest_complete`), read under
  the layout that fits the new world (:func:`~lightning_pipe.plan.elastic.elastic_stages`; the
  checkpoint reshards on load, as any resume under another layout);
- keeps the global batch: ``k`` fewer replicas accumulate proportionally more batches per step
  (:func:`~lightning_pipe.plan.elastic.kept_accumulation`), and the epoch's batch counts are
  rescaled to the new replicas' batches, so the samples of each step are those of the run before;
  where the accumulation would not be a whole number, each replica keeps its batch and the report
  says that the global batch changed;
- says what happened, on global rank 0 and to the Trainer's loggers: the restart count, the
  nodes lost (by host and agent process), the old and new layout, the step resumed from, the
  steps done again and the seconds lost since the checkpoint.

What the next start needs is kept with each checkpoint (the callback state of
:class:`ElasticState`) and, for the steps reached before a failure, in a small file that global
rank 0 rewrites after every step (``.lightning-pipe-elastic.json`` in the watched folder).
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

from lightning_pipe.checkpoint.newest import newest_complete
from lightning_pipe.config import PipelineConfig
from lightning_pipe.partition.placement import check_rank_order
from lightning_pipe.plan.elastic import elastic_stages, kept_accumulation, rescaled_count
from lightning_pipe.runtime.topology import Layout

log = logging.getLogger(__name__)

PROGRESS = ".lightning-pipe-elastic.json"
Setting = bool | str | Path


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
    folder where the user gave none, and an :class:`ElasticState` among the Trainer's callbacks.

    Each process looks for itself (before the process group exists): nothing writes to the folder
    while an elastic agent restarts the run, so all find the same one (checked in
    :meth:`ElasticState.setup`)."""
    if trainer.state.fn != TrainerFn.FITTING:
        return args, kwargs
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("RANK") == "0":
        log.warning(
            "lightning-pipe elastic: torchrun's agent shares its rendezvous store with the processes, and a restart "
            "then finds the addresses of the processes before it there (gloo: 'Connection refused' while connecting). "
            "Start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (see docs/elastic.md)."
        )
    folder = watched_folder(trainer, setting)
    bound = inspect.signature(function).bind(*args, **kwargs)
    found = None
    if "ckpt_path" in inspect.signature(function).parameters and bound.arguments.get("ckpt_path") is None:
        found = newest_complete(folder)
        if found is not None:
            bound.arguments["ckpt_path"] = str(found.path)
    for refused in found.refused if found is not None else ():
        log.warning("lightning-pipe elastic: passed over %s", refused)
    resumed = bound.arguments.get("ckpt_path")
    state = ElasticState(folder, str(resumed) if resumed is not None else None)
    callbacks = [c for c in trainer.callbacks if not isinstance(c, ElasticState)]  # type: ignore[attr-defined]
    trainer.callbacks = [*callbacks, state]  # type: ignore[attr-defined]  # the Trainer's list (no property stub)
    return bound.args, bound.kwargs


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
    """What an elastic restart needs from the run before it (kept with each checkpoint), and what
    this start did about it (``report``, on every rank, once training starts)."""

    def __init__(self, folder: Path, resumed: str | None) -> None:
        self.folder = folder
        self.resumed = resumed
        self.previous: dict[str, Any] | None = None
        self.report: dict[str, Any] | None = None
        self._trainer: pl.Trainer | None = None
        self._nodes: list[list[Any]] = []

    @property
    def state_key(self) -> str:
        return "lightning_pipe.ElasticState"

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        self._nodes = _nodes(trainer.global_rank)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            chosen = [self.resumed]
            dist.broadcast_object_list(chosen, 0)
            if chosen[0] != self.resumed:
                raise RuntimeError(
                    f"lightning-pipe elastic: rank {trainer.global_rank} found the checkpoint {self.resumed} to resume "
                    f"from, rank 0 found {chosen[0]}: the processes do not see the same files in {self.folder}. Give "
                    "every node the same folder (a shared file system), or resume with fit(ckpt_path=...)."
                )

    def _layout(self) -> tuple[int, int, int]:
        assert self._trainer is not None
        layout = self._trainer.strategy.layout  # type: ignore[attr-defined]  # PipelineStrategy's
        return layout.stages, layout.replicas, self._trainer.accumulate_grad_batches

    def state_dict(self) -> dict[str, Any]:
        if self._trainer is None:
            return {}
        stages, replicas, accumulate = self._layout()
        return {"stages": stages, "replicas": replicas, "accumulate": accumulate, "nodes": self._nodes,
                "saved_at": time.time()}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous = dict(state_dict) or None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.resumed is None:
            return
        now, previous = time.time(), self.previous or {}
        stages, replicas, accumulate = self._layout()
        old_replicas, old_accumulate = int(previous.get("replicas", replicas)), int(previous.get("accumulate", 1))
        kept = kept_accumulation(old_accumulate, old_replicas, replicas)
        if kept is not None:
            trainer.accumulate_grad_batches = accumulate = kept
        if old_replicas != replicas:
            _rescale_epoch_progress(trainer, old_replicas, replicas)
        progress = _read_progress(self.folder)
        step = trainer.global_step
        reached = int(progress["step"]) if progress is not None else None
        lost = [n for n in previous.get("nodes", []) if (n[0], n[1]) not in {(m[0], m[1]) for m in self._nodes}]
        self.report = {
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "checkpoint": self.resumed,
            "resumed_step": step,
            "steps_redone": max(reached - step, 0) if reached is not None else None,
            "seconds_lost": now - float(previous["saved_at"]) if "saved_at" in previous else None,
            "seconds_down": now - float(progress["time"]) if progress is not None else None,
            "lost_nodes": lost,
            "old_layout": [previous.get("stages"), old_replicas, old_accumulate],
            "new_layout": [stages, replicas, accumulate],
            "global_batch_kept": kept is not None,
        }
        if trainer.is_global_zero:
            _announce(trainer, self.report)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:  # the step reached, for the steps a restart does again
            self.folder.mkdir(parents=True, exist_ok=True)
            part = self.folder / f"{PROGRESS}.partial"
            part.write_text(json.dumps({"step": trainer.global_step, "time": time.time()}))
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
    line = (
        f"lightning-pipe elastic: restart {report['restart']}: lost {lost}; layout {old_text} -> "
        f"{layout_text(*new)}; resumed from step {report['resumed_step']} ({report['checkpoint']}); "
        f"{number(report['steps_redone'])} steps to do again; {number(report['seconds_lost'], ' s')} lost since the "
        f"checkpoint ({number(report['seconds_down'], ' s')} since the last step); global batch {batch}"
    )
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


__all__ = ["PROGRESS", "ElasticState", "describe_nodes", "layout", "resume_arguments", "resumer", "watched_folder"]
