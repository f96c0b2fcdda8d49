"""A Fabric training loop over ``FabricPipelineStrategy`` on N gloo processes (Fabric's fork launcher), and the
same loop on one process with Fabric's default strategy: the reference.

Each run writes what it ends with (every parameter it holds, the losses and clipped norms it was given, an
evaluation's loss) to ``folder/rank-R.pt``; a resumed run loads a ``fabric.save`` checkpoint first.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

LR, MAX_NORM = 0.1, 0.5


class MLP(nn.Module):
    """A user's model: its only Sequential is what the pipeline splits."""

    def __init__(self, depth: int = 8, width: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth - 1)]
        self.layers = nn.Sequential(*blocks, nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@dataclass  # not frozen: Fabric's spawn launcher rebuilds its arguments' dataclasses
class Run:
    """What one run trains: ``model`` ("mlp", "gpt2", "llama"), its batches, the strategy's arguments,
    ``precision``; ``save_after``: a ``fabric.save`` after that many steps; ``resume``: start from it;
    ``empty_init``: built under ``fabric.init_module(empty_init=True)`` (the meta device), the reference initialised
    as the pipeline initialises it (``init_like_pipeline``)."""

    model: str = "mlp"
    steps: int = 3
    samples: int = 12
    arguments: dict[str, Any] = field(default_factory=dict)
    precision: str = "32-true"
    momentum: float = 0.0
    save_after: int | None = None
    resume: bool = False
    empty_init: bool = False


def build(run: Run) -> nn.Module:
    torch.manual_seed(0)
    if run.model == "mlp":
        return MLP()
    from tests import hf_models

    return hf_models.gpt2() if run.model == "gpt2" else hf_models.llama(tied=False)


def loader(run: Run) -> DataLoader:
    """The run's batches in order (no shuffling: one process and N read the same ones)."""
    g = torch.Generator().manual_seed(1)
    n = run.samples * (run.steps + 1)
    if run.model == "mlp":
        data = TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 6, generator=g))
    else:
        data = TensorDataset(torch.randint(0, 96, (n, 8), generator=g))
    return DataLoader(data, batch_size=run.samples, shuffle=False)


def loss_of(run: Run, model: Any) -> Any:
    """The loss of one (micro-)batch: ``model`` is the module ``fabric.setup`` returned."""
    if run.model == "mlp":
        return lambda batch: F.mse_loss(model(batch[0]), batch[1])
    return lambda batch: model(input_ids=batch[0], labels=batch[0]).loss


def train(fabric: Any, run: Run, folder: str, step_fn: Any) -> dict[str, Any]:
    """The loop both runs share; ``step_fn(model, batch, loss_fn) -> loss`` does the forward and backward."""
    fabric.seed_everything(0)
    pipelined = hasattr(fabric.strategy, "train_step")
    with fabric.init_module(empty_init=True) if run.empty_init and pipelined else contextlib.nullcontext():
        model = build(run)
    if run.empty_init and not pipelined:  # the reference: the pipeline's initialisation of each layer
        from lightning_pipe import init_like_pipeline

        init_like_pipeline(model)
    on_meta = any(p.is_meta for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=run.momentum)
    model, optimizer = fabric.setup(model, optimizer)
    batches = fabric.setup_dataloaders(loader(run))
    second_refused = False
    if pipelined:  # one pipelined model per Fabric: a second setup is refused, naming what to do
        try:
            fabric.setup_module(nn.Linear(2, 2))
        except RuntimeError as error:
            second_refused = "use other models" in str(error)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if run.resume:
        fabric.load(Path(folder) / "checkpoint", state)
    losses, norms = [], []
    loss_fn = loss_of(run, model)
    *train_batches, held_out = list(batches)
    for step, batch in enumerate(train_batches):
        if step < state["step"]:
            continue
        loss = step_fn(model, batch, loss_fn)
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        state["step"] = step + 1
        if run.save_after == step + 1 and folder:  # the pipelined runs (the reference has no folder)
            fabric.save(Path(folder) / "checkpoint", state)
    evaluated = float(_evaluate(fabric, model, held_out, loss_fn))
    params = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {
        "state": params,
        "losses": losses,
        "norms": norms,
        "evaluated": evaluated,
        "on_meta": on_meta,
        "second_refused": second_refused,
    }


def _evaluate(fabric: Any, model: Any, batch: Any, loss_fn: Any) -> torch.Tensor:
    if hasattr(fabric.strategy, "evaluate"):
        return fabric.strategy.evaluate(model, batch, loss_fn)
    with torch.no_grad():
        return loss_fn(batch)


def precision(run: Run) -> dict[str, Any]:
    """Fabric's precision argument; ``"16-mixed"`` as its plugin with a gradient scaler on the CPU (Fabric's own
    connector turns ``precision="16-mixed"`` into bf16 there)."""
    if run.precision != "16-mixed":
        return {"precision": run.precision}
    from lightning.fabric.plugins import MixedPrecision

    return {"plugins": [MixedPrecision("16-mixed", device="cpu")]}


def single_process(run: Run) -> dict[str, Any]:
    """The reference: Fabric on one CPU process, the whole model, ``fabric.backward``."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, **precision(run))

    def step(model: Any, batch: Any, loss_fn: Any) -> torch.Tensor:
        loss = loss_fn(batch)
        fabric.backward(loss)
        return loss.detach()

    result = train(fabric, run, "", step)
    return copy.deepcopy(result)


def _worker(fabric: Any, run: Run, folder: str) -> None:
    torch.set_num_threads(1)
    result = train(fabric, run, folder, fabric.strategy.train_step)
    torch.save(result, Path(folder) / f"rank-{fabric.global_rank}.pt")


def fabric_pipeline_run(folder: Path, world: int, run: Run, start_method: str = "fork") -> list[dict[str, Any]]:
    """``world`` processes started by Fabric's own launcher (fork, or ``start_method``), each running :func:`train`."""
    from lightning.fabric import Fabric

    from lightning_pipe import FabricPipelineStrategy

    os.environ["OMP_NUM_THREADS"] = "1"
    strategy = FabricPipelineStrategy(start_method=start_method, **run.arguments)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, **precision(run))
    fabric.launch(_worker, run, str(folder))
    return [torch.load(folder / f"rank-{r}.pt", weights_only=False) for r in range(world)]
