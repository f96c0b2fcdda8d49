"""``python peak_memory.py OUT --devices N --runs W:BUILD,...``: each rank's peak resident memory when
training starts, for each run (BUILD: eager or configure_model), in ``OUT/W-BUILD/rank<k>.json`` (kB).

The model is 16 x Linear(W, W) (W=2048: 256 MiB of float32 parameters). ``eager`` builds it in
``__init__`` in this process, before the ranks are forked; ``configure_model`` builds it in the
hook, on the meta device. Each rank resets its peak (``/proc/self/clear_refs``) when Lightning sets
it up, so the peak counts what the rank holds (memory inherited from this process included) and
what it allocates until ``on_fit_start``, not this process's earlier peaks."""

import argparse
import json
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_pipe import PipelineStrategy
from tests.models import trainer_kwargs

LAYERS = 16


def memory_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class WideNet(L.LightningModule):
    def __init__(self, width: int, deferred: bool) -> None:
        super().__init__()
        self.width = width
        self.layers = None if deferred else self.build()

    def build(self) -> nn.Sequential:
        return nn.Sequential(*[nn.Linear(self.width, self.width) for _ in range(LAYERS)])

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = self.build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)


class PeakAtFitStart(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident size
        except OSError:
            pass

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        values = {"peak_kb": memory_kb("VmHWM"), "rss_kb": memory_kb("VmRSS")}
        values["param_bytes"] = sum(p.numel() * p.element_size() for p in pl_module.parameters() if not p.is_meta)
        with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(values, f)


def measure(out: str, devices: int, width: int, build: str, start_method: str) -> None:
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    os.makedirs(out, exist_ok=True)
    if "LOCAL_RANK" not in os.environ:  # popen children take the port their launcher chose
        os.environ["MASTER_PORT"] = str(find_free_network_port())
    model = WideNet(width, deferred=build == "configure_model")
    data = DataLoader(TensorDataset(torch.randn(4, width), torch.randn(4, width)), batch_size=4)
    strategy = PipelineStrategy(start_method=start_method, chunks=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        callbacks=[PeakAtFitStart(out)],
        **trainer_kwargs(max_steps=1),
    )
    trainer.fit(model, data)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument(
        "--runs",
        default="8:configure_model,2048:configure_model,2048:eager",
        help="comma-separated WIDTH:BUILD runs, one after the other (one run only with --start-method popen); "
        "each writes OUT/WIDTH-BUILD/rank<k>.json",
    )
    parser.add_argument("--start-method", default="fork")
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    for run in args.runs.split(","):
        width, build = run.split(":")
        measure(os.path.join(args.out, f"{width}-{build}"), args.devices, int(width), build, args.start_method)
