"""The ``lightning-pipe`` command: Hydra configuration in ``conf/``, recipes in ``recipes/``.

    lightning-pipe                                        # tiny BERT, 2 CPU stages, offline
    lightning-pipe recipe=vgg19_cifar100 strategy=gpipe strategy.chunks=8 trainer.devices=4
    lightning-pipe -m strategy.chunks=2,4                 # a sweep, one output folder per run
    lightning-pipe --cfg job                              # print the composed configuration
"""

from __future__ import annotations

import time
from importlib.resources import files
from pathlib import Path
from typing import Any, Optional

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from lightning_pipe.runtime.microbatch import batch_size
from lightning_pipe.strategy import PipelineStrategy

CONFIG_DIR = str(Path(str(files("lightning_pipe.conf"))).resolve())
STRATEGY_KEYS = (
    "schedule", "chunks", "balance", "checkpoint", "module", "start_method", "gradient_accumulation_fusion", "stages",
    "data_parallel",
)


class SamplesPerSecond(L.Callback):
    """Logs ``samples_per_sec`` (shown in the progress bar) from each step's wall time."""

    def __init__(self) -> None:
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        seconds = time.perf_counter() - self._start
        pl_module.log("samples_per_sec", batch_size(batch) / seconds, prog_bar=True, on_step=True, on_epoch=False)


def build_strategy(cfg: DictConfig, devices: Any) -> tuple[Any, Any]:
    """The Trainer's ``strategy`` and ``devices`` for the ``strategy`` config group."""
    if cfg.name == "none":
        return "auto", 1
    if cfg.name != "pipeline":
        raise ValueError(f"strategy.name={cfg.name!r}: valid names are 'pipeline' and 'none'.")
    args = {k: cfg[k] for k in STRATEGY_KEYS if k in cfg and cfg[k] is not None}
    if "balance" in args and not isinstance(args["balance"], str):
        args["balance"] = [int(n) for n in args["balance"]]
    return PipelineStrategy(**args), devices


def run(cfg: DictConfig, output_dir: Optional[str] = None) -> dict[str, float]:
    """Train the configured recipe; returns the final metrics (on every rank)."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    output = Path(output_dir or HydraConfig.get().runtime.output_dir)
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert isinstance(trainer_cfg, dict)
    strategy, devices = build_strategy(cfg.strategy, trainer_cfg.pop("devices"))
    model = instantiate(cfg.recipe.model)
    data = instantiate(cfg.recipe.data)
    callbacks: list[L.Callback] = [SamplesPerSecond()]
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
    trainer.fit(model, datamodule=data)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> Optional[float]:
    metrics = run(cfg)
    return metrics.get("train_loss")


if __name__ == "__main__":
    main()
