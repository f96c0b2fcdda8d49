"""The ``lightning-pipe`` command: Hydra configuration in ``conf/``, recipes in ``recipes/``.

    lightning-pipe                                        # tiny BERT, 2 CPU stages, offline
    lightning-pipe recipe=vgg19_cifar100 strategy=gpipe strategy.chunks=8 trainer.devices=4
    lightning-pipe -m strategy.chunks=2,4                 # a sweep, one output folder per run
    lightning-pipe --cfg job                              # print the composed configuration
"""

from __future__ import annotations

import logging
import os
import sys
import time
from importlib.resources import files
from pathlib import Path
from typing import Any, Optional

import hydra
import lightning as L
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from lightning_pipe.partition import find_sequential, resolve_balance, tied_parameters
from lightning_pipe.runtime.microbatch import batch_size
from lightning_pipe.strategy import PipelineStrategy

log = logging.getLogger(__name__)

# what Lightning's script launcher sets in the environment for the processes of a run
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
CONFIG_DIR = str(Path(str(files("lightning_pipe.conf"))).resolve())
STRATEGY_KEYS = (
    "schedule", "chunks", "balance", "checkpoint", "module", "start_method", "gradient_accumulation_fusion", "weights",
    "plan",
    "stages", "data_parallel",
    "virtual_stages", "check_data",
)  # fmt: skip


class SamplesPerSecond(L.Callback):
    """Logs ``samples_per_sec`` (shown in the progress bar) from each step's wall time."""

    def __init__(self) -> None:
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        seconds = time.perf_counter() - self._start
        pl_module.log("samples_per_sec", batch_size(batch) / seconds, prog_bar=True, on_step=True, on_epoch=False)


class PlanOnly(L.Callback):
    """``lightning-pipe plan``: once the planner ranked the layouts (in the strategy's setup), print
    and write them (``plan.txt``, ``plan.svg``) and stop before the first step."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_pipe.plan.report import write_plan

        trainer.should_stop = True
        if trainer.global_rank == 0 and getattr(trainer.strategy, "plan_candidates", None):
            print(write_plan(trainer.strategy.plan_candidates, trainer.strategy.num_stages, self.folder))
            print(f"written: {self.folder / 'plan.txt'}, {self.folder / 'plan.svg'}")


def build_strategy(cfg: DictConfig, devices: Any) -> tuple[Any, Any]:
    """The Trainer's ``strategy`` and ``devices`` for the ``strategy`` config group."""
    if cfg.name == "none":
        if str(devices) != "1":
            log.warning(
                "strategy=none: training without the pipeline, in one process on one device; trainer.devices=%s "
                "applies to the pipeline strategies (strategy=1f1b, gpipe, pipedream, pipedream_2bw).",
                devices,
            )
        return "auto", 1
    if cfg.name != "pipeline":
        raise ValueError(f"strategy.name={cfg.name!r}: valid names are 'pipeline' and 'none'.")
    args = {k: cfg[k] for k in STRATEGY_KEYS if k in cfg and cfg[k] is not None}
    if "balance" in args and not isinstance(args["balance"], str):
        args["balance"] = [int(n) for n in args["balance"]]
    return PipelineStrategy(**args), devices


def check_tied_weights(cfg: DictConfig, model: L.LightningModule, devices: Any) -> None:
    """``schedule=pipedream`` refuses weights tied across stages; say so before any process starts,
    naming the override that unties them (the strategy itself would fail in every process)."""
    if cfg.strategy.name != "pipeline" or cfg.strategy.schedule != "pipedream" or not isinstance(devices, int) or devices < 2:
        return
    try:
        attribute, layers = find_sequential(model, cfg.strategy.get("module"))
        balance = cfg.strategy.balance
        balance = balance if isinstance(balance, str) else [int(n) for n in balance]
        ties = tied_parameters(layers, resolve_balance(balance, layers, devices))
    except (ValueError, TypeError):
        return  # a bad module or balance: the strategy names it
    if not ties:
        return
    names = ", ".join(sorted({f"{attribute}.{name}" for tie in ties for name in tie.values()}))
    fix = (
        "add recipe.model.tie_embeddings=false"
        if "tie_embeddings" in cfg.recipe.model
        else "untie them in the model"
    )
    raise SystemExit(
        f"lightning-pipe: strategy=pipedream cannot train weights shared by layers of different stages ({names}): "
        f"{fix}, or use strategy=pipedream_2bw."
    )


def run(cfg: DictConfig, output_dir: Optional[str] = None) -> dict[str, float]:
    """Train the configured recipe; returns the final metrics (on every rank)."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    output = Path(output_dir or HydraConfig.get().runtime.output_dir)
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert isinstance(trainer_cfg, dict)
    strategy, devices = build_strategy(cfg.strategy, trainer_cfg.pop("devices"))
    model = instantiate(cfg.recipe.model)
    check_tied_weights(cfg, model, devices)
    data = instantiate(cfg.recipe.data)
    callbacks: list[L.Callback] = [SamplesPerSecond()]
    if cfg.get("plan_only", False):
        callbacks.append(PlanOnly(output))
    if cfg.get("timeline", False) and cfg.strategy.name == "pipeline":
        from lightning_pipe.plan.picture import TimelinePicture

        callbacks.append(TimelinePicture(output / "timeline.svg", log=False))  # the CSVLogger below takes no images
    if cfg.get("checkpoint", False):
        callbacks.append(ModelCheckpoint(dirpath=output / "checkpoints", save_last=True))
    trainer = L.Trainer(
        strategy=strategy,
        devices=devices,
        default_root_dir=str(output),
        logger=CSVLogger(str(output), name="logs"),
        callbacks=callbacks,
        enable_checkpointing=bool(cfg.get("checkpoint", False)),
        **trainer_cfg,
    )
    environment = {k: os.environ.get(k) for k in LAUNCH_VARIABLES}
    try:
        trainer.fit(model, datamodule=data)
    finally:
        _end_job(environment)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def _end_job(environment: dict[str, Optional[str]]) -> None:
    """Leave nothing of this job's processes behind for the next job of a sweep, which runs in this
    process and starts its own extra processes: the process group, and the variables Lightning's
    launcher set (with ``LOCAL_RANK`` set, Lightning would take the processes as started already).
    The next job gets a new port even where ``MASTER_PORT`` was given: this process may still hold
    the finished job's store on the old one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in environment.items():
        if value is None or key == "MASTER_PORT":
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def _main(cfg: DictConfig) -> Optional[float]:
    metrics = run(cfg)
    return metrics.get("train_loss")


def main() -> None:
    """``lightning-pipe [plan] <overrides>``: ``plan`` ranks the layouts for the configured run
    (``strategy.plan=auto``) and stops before training."""
    if sys.argv[1:2] == ["plan"]:
        sys.argv[1:2] = ["strategy.plan=auto", "+plan_only=true"]
    _main()


if __name__ == "__main__":
    main()
