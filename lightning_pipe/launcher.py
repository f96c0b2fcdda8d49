"""Process launch for ``start_method="spawn"`` / ``"fork"``.

Lightning's own multiprocessing launcher does the work, with two differences that matter for a
pipeline: the weights sent back to the main process are the whole model, gathered from every
stage (so ``trainer.fit`` in a notebook leaves the notebook's module trained, as with
``DDPStrategy``), and ``trainer.predict`` returns rank 0's predictions there. The launcher is a
wrapper rather than a subclass because Lightning refuses ``return_predictions`` for launchers of
the ``_MultiProcessingLauncher`` class.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning_pipe.runtime.sharding import full_tensor
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput


class _GatheringLauncher(_MultiProcessingLauncher):
    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Optional["_WorkerOutput"]:
        module = trainer.lightning_module
        original = module.state_dict

        def full_state_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
            # sharded stages: every replica takes part in gathering each whole tensor
            local = {k: full_tensor(v).detach().cpu() for k, v in original(*args, **kwargs).items()}
            if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
                return local
            group = getattr(self._strategy, "_meta_group", None)  # this rank's pipeline: every stage once
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, local, group=group)
            merged: dict[str, Any] = {}
            for part in gathered:
                merged.update(part)
            return merged

        module.state_dict = full_state_dict  # type: ignore[method-assign]
        try:
            output = super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict
        if output is not None and output.trainer_results is not None:
            # Tensors put on the queue are shared through file descriptors that vanish with the worker.
            buffer = io.BytesIO()
            torch.save(output.trainer_results, buffer)
            output = output._replace(trainer_results=_Serialized(buffer.getvalue()))
        return output


class _Serialized(bytes):
    """The worker's results as bytes, to be loaded in the main process."""


class PipelineMultiProcessingLauncher(_Launcher):
    def __init__(self, strategy: "pl.strategies.Strategy", start_method: str) -> None:
        self._inner = _GatheringLauncher(strategy, start_method=start_method)  # type: ignore[arg-type]

    @property
    def is_interactive_compatible(self) -> bool:
        return self._inner.is_interactive_compatible

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        results = self._inner.launch(function, *args, trainer=trainer, **kwargs)
        if isinstance(results, _Serialized):
            # our own worker's output (predictions may be any picklable object), not a file from elsewhere
            results = torch.load(io.BytesIO(results), weights_only=False)
        return results

    def kill(self, signum: Any) -> None:
        self._inner.kill(signum)
