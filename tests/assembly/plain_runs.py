"""A plain PyTorch loop over ``build_pipeline`` on N gloo processes, and the same loop in one process.

Each process writes what it ends with (its stage's weights, the losses it was given, the clipped norms,
an evaluation's loss) to ``folder/rank-R.pt``; the test compares them with :func:`plain_training`'s.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STEPS, LR, MAX_NORM = 3, 0.1, 0.5


class Net(nn.Module):
    """A user's model: its only Sequential is what the pipeline splits."""

    def __init__(self, depth: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def batches(replicas: int = 1, samples: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of the run (every replica reads its ``1/replicas`` of each)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(samples * replicas, 6, generator=g), torch.randn(samples * replicas, 6, generator=g))
            for _ in range(STEPS + 1)]  # fmt: skip


def loss_fn(model: nn.Module) -> Any:
    return lambda batch: F.mse_loss(model(batch[0]), batch[1])


def plain_training(replicas: int = 1) -> dict[str, Any]:
    """One process, the whole model, the same steps: the reference."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    *train, held_out = batches(replicas)
    losses, norms = [], []
    for batch in train:
        optimizer.zero_grad()
        loss = loss_fn(model)(batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        evaluated = float(loss_fn(model)(held_out))
    return {"state": copy.deepcopy(model.state_dict()), "losses": losses, "norms": norms, "evaluated": evaluated}


def two_bw_training() -> dict[str, Any]:
    """PipeDream-2BW's rule in one process, unclipped: ``W(t+1) = W(t) - lr * grad f(W(t-1))``."""
    model = Net()
    *train, held_out = batches()
    losses, previous = [], None
    for batch in train:
        model.zero_grad()
        loss = loss_fn(model)(batch)
        loss.backward()
        losses.append(float(loss.detach()))
        grads = [p.grad.clone() for p in model.parameters()]
        if previous is not None:
            with torch.no_grad():
                for p, g in zip(model.parameters(), previous):
                    p.sub_(LR * g)
        previous = grads
    with torch.no_grad():
        evaluated = float(loss_fn(model)(held_out))
    return {"state": copy.deepcopy(model.state_dict()), "losses": losses, "evaluated": evaluated}


def worker(rank: int, world: int, folder: str, arguments: dict[str, Any]) -> None:
    """One rank of the plain loop: its replica's part of every batch, clipped (synchronous schedules) and
    stepped; then saved."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import lightning_pipe

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        model = Net()
        pipe = lightning_pipe.build_pipeline(model, **arguments)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=LR)
        clips = pipe.pipeline.asynchronous is None
        replicas, replica = pipe.placement.num_replicas, pipe.placement.replica
        *train, held_out = batches(replicas)
        losses, norms = [], []
        for x, y in train:
            part = (x.chunk(replicas)[replica], y.chunk(replicas)[replica])
            optimizer.zero_grad()
            losses.append(float(pipe.train_step(part, loss_fn(model))))
            if clips:
                norms.append(float(pipe.clip_grad_norm_(MAX_NORM)))
            optimizer.step()
        x, y = held_out
        evaluated = float(pipe.evaluate((x.chunk(replicas)[replica], y.chunk(replicas)[replica]), loss_fn(model)))
        pipe.save(Path(folder) / "checkpoint", [optimizer], global_step=STEPS)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        pipe.close()
        again = Net()  # a new run of the same layout, resumed from the save
        resumed = lightning_pipe.build_pipeline(again, **arguments)
        extra = resumed.load(Path(folder) / "checkpoint", [torch.optim.SGD(resumed.parameters(), lr=LR)])
        loaded = {k: v.clone() for k, v in again.state_dict().items()}
        resumed.close()
        result = {"state": state, "losses": losses, "norms": norms, "evaluated": evaluated, "loaded": loaded}
        result["extra"] = {k: v for k, v in extra.items() if k == "global_step"}
        torch.save(result, Path(folder) / f"rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_plain_pipeline(folder: Path, world: int, **arguments: Any) -> list[dict[str, Any]]:
    """``world`` processes (forked) running :func:`worker`; what each rank wrote."""
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(world, str(folder), arguments), nprocs=world, start_method="fork")
    return [torch.load(folder / f"rank-{r}.pt", weights_only=False) for r in range(world)]
