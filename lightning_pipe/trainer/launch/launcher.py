"""Process launch: ``start_method="popen"`` under Hydra, and ``"spawn"`` / ``"fork"``.

``popen`` (scripts and the command line) is Lightning's script launcher, which re-runs the command
line once per extra process. Under a Hydra sweep (``lightning-pipe -m ...``) Lightning's command
would re-run the whole sweep in every extra process; :func:`hydra_child_command` gives each
one the job's own overrides and output folder instead (:func:`script_launcher`).

For ``spawn`` / ``fork``, Lightning's own multiprocessing launcher does the work, with two
differences that matter for a pipeline: the weights sent back to the main process are the whole
model, gathered from every
stage (so ``trainer.fit`` in a notebook leaves the notebook's module trained, as with
``DDPStrategy``; not for a module built in ``configure_model()``, which may not fit one process:
save a checkpoint instead), and ``trainer.predict`` returns rank 0's predictions there. The launcher is a
wrapper rather than a subclass because Lightning refuses ``return_predictions`` for launchers of
the ``_MultiProcessingLauncher`` class.
"""

from __future__ import annotations

import functools
import io
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_pipe.runtime.replicas.sharding import full_tensor
from lightning_pipe.trainer import internals

#: ``(trainer, function, args, kwargs) -> (args, kwargs)``: a Trainer function's arguments, changed before it runs
Arguments = Callable[[pl.Trainer, Callable, tuple, dict], tuple[tuple, dict]]


@dataclass(frozen=True)
class Gathering:
    """How a worker's whole weights are put together for the main process.

    Attributes:
        group: a group of rank 0 and every sender, where rank 0 gathers the stages (None: the default
            group); the other ranks take no part.
        senders: global ranks of replica 0's stages, whose weights rank 0 gathers wherever it sits:
            they are the checkpoint's, and under ``replicas_sync="elastic"`` the replicas differ.
        whole: False for a module built on the meta device (it may not fit one process): nothing is
            sent back.
    """

    group: ProcessGroup | None = None
    senders: Sequence[int] = (0,)
    whole: bool = True


def _end_process_group() -> None:
    """After Lightning's worker: a clean end of the process group. A spawned worker exits through
    the interpreter's full shutdown, and with gloo's connections and threads still open it was
    aborted there now and then (``terminate called without an active exception``, SIGABRT) after
    training had succeeded. Every rank first waits for the others to be done with the group, so
    that none closes its connections while a peer still uses them."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def _collect_whole_weights(
    gathering: Callable[[], Gathering], trainer: pl.Trainer, lightning: Callable[[], Any]
) -> Any:
    """Lightning's rank-zero results (``lightning()``) with the whole model's weights, gathered
    from every stage, and the trainer's results as bytes."""
    module = trainer.lightning_module
    original = module.state_dict
    gathered_how = gathering()

    def full_state_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
        if not gathered_how.whole:  # built on the meta device because it may not fit one process: sent nowhere
            return {}
        # sharded stages: every replica takes part in gathering each whole tensor
        local = {k: full_tensor(v).detach().cpu() for k, v in original(*args, **kwargs).items()}
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return local
        # rank 0 gathers replica 0's stages, wherever rank 0 and they sit (rank_order); only rank 0's
        # result is sent back, so the other ranks' is whatever they hold
        group, senders, rank = gathered_how.group, gathered_how.senders, dist.get_rank()
        if rank != 0 and rank not in senders:
            return local
        gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object(local if rank in senders else {}, gathered, dst=0, group=group)
        merged: dict[str, Any] = {}
        for part in gathered or [local]:
            merged.update(part)
        return merged

    # Lightning sends back what the module's state_dict gives: for this call, the whole model
    with internals.sent_state_dict(module, full_state_dict):
        output = lightning()
    if output is not None and output.trainer_results is not None:
        # Tensors put on the queue are shared through file descriptors that vanish with the worker.
        buffer = io.BytesIO()
        torch.save(output.trainer_results, buffer)
        output = output._replace(trainer_results=_Serialized(buffer.getvalue()))
    return output


class _Serialized(bytes):
    """The worker's results as bytes, to be loaded in the main process."""


class PipelineMultiProcessingLauncher(internals.launcher_class()):  # type: ignore[misc]
    """Lightning's multiprocessing launcher, gathering rank 0's results; ``before(module,
    accumulate_grad_batches=...)`` runs on the launching process before any worker starts (what can be
    refused there, is)."""

    def __init__(
        self,
        strategy: pl.strategies.Strategy,
        start_method: str,
        gathering: Callable[[], Gathering],
        before: Callable[..., None] | None = None,
        arguments: Arguments | None = None,
    ) -> None:
        self._inner = internals.multiprocessing_launcher(
            strategy, start_method, _end_process_group, functools.partial(_collect_whole_weights, gathering)
        )
        self._before = before
        self._arguments = arguments

    @property
    def is_interactive_compatible(self) -> bool:
        return self._inner.is_interactive_compatible

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if self._before is not None and trainer is not None:
            self._before(trainer.lightning_module, accumulate_grad_batches=trainer.accumulate_grad_batches)
        if self._arguments is not None and trainer is not None:
            args, kwargs = self._arguments(trainer, function, args, kwargs)
        results = self._inner.launch(function, *args, trainer=trainer, **kwargs)
        if isinstance(results, _Serialized):
            # our own worker's output (predictions may be any picklable object), not a file from elsewhere
            results = torch.load(io.BytesIO(results), weights_only=False)
        return results

    def kill(self, signum: Any) -> None:
        self._inner.kill(signum)


def launcher_for(
    strategy: Any,
    start_method: str,
    gathering: Callable[[], Gathering],
    before: Callable[..., None] | None = None,
    arguments: Arguments | None = None,
) -> Any:
    """Lightning's script launcher, Hydra-aware, for ``"popen"``; else its multiprocessing launcher,
    which gathers the whole model back (``gathering``: where from, once the processes are set up).
    ``before(module, accumulate_grad_batches=...)``: run on the launching process before it starts any other;
    ``arguments(trainer, function, args, kwargs)``: the Trainer function's arguments, changed
    (elastic runs resume from the newest checkpoint), in every process that runs it."""
    if start_method == "popen":
        environment, processes, nodes = strategy.cluster_environment, strategy.num_processes, strategy.num_nodes
        return PipelineScriptLauncher(environment, processes, nodes, before, arguments)
    return PipelineMultiProcessingLauncher(strategy, start_method, gathering, before, arguments)


# Hydra overrides that make sense for the sweep only, or that the child's command sets itself.
_SWEEP_ONLY = ("hydra.mode", "hydra.run.", "hydra.sweep.", "hydra.sweeper", "hydra/sweeper", "hydra.launcher",
               "hydra/launcher", "hydra.job.name", "hydra.output_subdir")  # fmt: skip


def hydra_child_command(local_rank: int) -> tuple[list[str], str]:
    """The command and working directory for extra process ``local_rank`` of the current Hydra job:
    the job's own overrides (one job of a sweep, never the sweep) writing into the job's folder."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    config = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += child_overrides(config.overrides.task, config.overrides.hydra)
    command += [
        f'hydra.run.dir="{config.runtime.output_dir}"',
        f"hydra.job.name=train_ddp_process_{local_rank}",
        "hydra.output_subdir=null",  # the job's config is already saved by rank 0
    ]
    return command, get_original_cwd()


def child_overrides(task: Sequence[str], hydra: Sequence[str]) -> list[str]:
    """A job's overrides for its extra processes: all of the job's own (in a sweep, the values of
    this job), and Hydra's except those of the sweep."""
    return [*task, *(o for o in hydra if not o.lstrip("+~").startswith(_SWEEP_ONLY))]


class PipelineScriptLauncher(internals.launcher_class()):  # type: ignore[misc]
    """Lightning's script launcher (``start_method="popen"``) with :func:`hydra_child_command`;
    ``before(module, accumulate_grad_batches=...)`` runs on the launching process before it starts the others."""

    def __init__(
        self,
        cluster_environment: Any,
        num_processes: int,
        num_nodes: int,
        before: Callable[..., None] | None = None,
        arguments: Arguments | None = None,
    ) -> None:
        self._inner = internals.script_launcher(cluster_environment, num_processes, num_nodes, hydra_child_command)
        self._before = before
        self._arguments = arguments

    @property
    def is_interactive_compatible(self) -> bool:
        return self._inner.is_interactive_compatible

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if (
            self._before is not None
            and trainer is not None
            and not self._inner.cluster_environment.creates_processes_externally
        ):
            self._before(trainer.lightning_module, accumulate_grad_batches=trainer.accumulate_grad_batches)
        if self._arguments is not None and trainer is not None:
            args, kwargs = self._arguments(trainer, function, args, kwargs)
        return self._inner.launch(function, *args, trainer=trainer, **kwargs)

    def kill(self, signum: Any) -> None:
        self._inner.kill(signum)
