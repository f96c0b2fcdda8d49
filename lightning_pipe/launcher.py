"""Process launch for ``start_method="spawn"`` / ``"fork"``: Lightning's own launcher, except that
the weights sent back to the main process are the whole model, gathered from every stage, so
``trainer.fit`` in a notebook leaves the main process's module trained, as with ``DDPStrategy``."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput


class PipelineMultiProcessingLauncher(_MultiProcessingLauncher):
    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Optional["_WorkerOutput"]:
        module = trainer.lightning_module
        original = module.state_dict

        def full_state_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
            local = {k: v.detach().cpu() for k, v in original(*args, **kwargs).items()}
            if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
                return local
            gathered: list[Any] = [None] * dist.get_world_size()
            group = getattr(self._strategy, "_meta_group", None)
            dist.all_gather_object(gathered, local, group=group)
            merged: dict[str, Any] = {}
            for part in gathered:
                merged.update(part)
            return merged

        module.state_dict = full_state_dict  # type: ignore[method-assign]
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict
