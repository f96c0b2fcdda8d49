"""DeepSpeed's pipeline engine as a contender for ``compare.py``: ``deepspeed_1f1b``.

DeepSpeed's only training schedule (``TrainSchedule``) is 1F1B. The contender trains the same
model, stage split (``balance="parameters"``), micro-batches, loss and SGD as ``torch_1f1b``,
on 2 CPU processes with gloo and one thread each, timing ``engine.train_batch`` on rank 0.
DeepSpeed is optional: ``available()`` says why it cannot run here.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import itertools
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

INSTALL = "pip install 'lightning-pipe[bench]'"


def _cpu() -> None:
    # DeepSpeed picks its accelerator once, at import: CUDA wherever a GPU is visible, else CPU with a warning
    os.environ["DS_ACCELERATOR"] = "cpu"


def available() -> str | None:
    """None when DeepSpeed imports with its CPU accelerator; otherwise why not, in one line."""
    _cpu()
    try:
        import deepspeed  # noqa: F401
        from deepspeed.accelerator import get_accelerator
        from deepspeed.pipe import PipelineModule  # noqa: F401
    except ImportError as e:
        if e.name == "deepspeed":
            return f"deepspeed is not installed: {INSTALL}"
        return f"deepspeed does not import: {e}"
    except Exception as e:  # DeepSpeed's import runs accelerator and op-builder probes
        return f"deepspeed does not import: {type(e).__name__}: {e}"
    name = get_accelerator().device_name()
    if name != "cpu":
        return f"deepspeed chose accelerator {name!r}, not cpu (it was imported before DS_ACCELERATOR=cpu)"
    return None


def _pipeline_module() -> type:
    """PipelineModule that takes explicit stage boundaries: ``partition_method="parts:0,5,9"``.

    DeepSpeed's own ``"parameters"`` method balances with a different solver than
    lightning-pipe's, so it is overridden rather than trusted to agree."""
    from deepspeed.pipe import PipelineModule

    class ExplicitSplit(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            if not method.startswith("parts:"):
                return super()._partition_layers(method)
            self.parts = [int(b) for b in method[len("parts:") :].split(",")]
            assert len(self.parts) == self.num_stages + 1 and self.parts[-1] == len(self._layer_specs), self.parts
            self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    return ExplicitSplit


def _micro_batches(model: str, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """workload.data's batches, each cut into ``chunks`` micro-batches as torch's schedules do."""
    from workload import MODELS, data

    spec: dict[str, Any] = MODELS[model]
    for x, y in data(model, spec["batch"], steps):
        yield from zip(x.chunk(spec["chunks"]), y.chunk(spec["chunks"]), strict=True)


def _worker(rank: int, model: str, steps: int, warmup: int, port: int, folder: str) -> None:
    from step_time import intervals
    from workload import MODELS, STAGES, build_module

    from lightning_pipe.partition import resolve_balance, stage_layers

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(STAGES), LOCAL_WORLD_SIZE=str(STAGES),
    )  # fmt: skip
    _cpu()
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    # the CPU backend's shared-memory all-reduce serves inference only: skip its JIT C++ build (~30 s,
    # g++ and ninja); import_module because the attribute deepspeed.comm.torch is the torch package
    comm: Any = importlib.import_module("deepspeed.comm.torch")
    comm.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    spec: dict[str, Any] = MODELS[model]
    m = spec["chunks"]
    layers = cast(nn.Sequential, build_module(model).layers)
    balance = resolve_balance("parameters", layers, STAGES)
    bounds = [0, *itertools.accumulate(balance)]
    config: dict[str, Any] = {
        "train_batch_size": spec["batch"], "train_micro_batch_size_per_gpu": spec["batch"] // m,
        "gradient_accumulation_steps": m, "steps_per_print": 10**9, "wall_clock_breakdown": False,
        "fp16": {"enabled": False}, "bf16": {"enabled": False},
        "gradient_clipping": 0.0,  # DeepSpeed's default, 1.0, would clip (and all-reduce a norm) where torch does not
    }  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its seeds and config on rank 0
        parts = "parts:" + ",".join(map(str, bounds))
        net = _pipeline_module()(list(layers), num_stages=STAGES, loss_fn=F.cross_entropy, partition_method=parts)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    ours = {id(p) for layer in stage_layers(layers, balance, rank).values() for p in layer.parameters()}
    assert {id(p) for p in engine.module.parameters()} == ours, f"DeepSpeed's stage {rank} is not balance {balance}'s"
    # initialize's garbage would otherwise set off a full collection of the heap forked from the
    # parent (~0.25 s, once per rank) around step 3: collect it here, outside the timed steps
    gc.collect()
    batches = _micro_batches(model, steps)
    ends: list[float] = []
    losses: list[float] = []
    for _ in range(steps):
        loss = engine.train_batch(batches)  # cuts the next micro-batches, runs 1F1B, steps SGD
        ends.append(time.perf_counter())
        losses.append(loss.item())
    if rank == 0:
        with open(os.path.join(folder, "times.json"), "w") as f:
            json.dump(intervals(ends, warmup), f)  # end to end, as compare.py times every contender
        with open(os.path.join(folder, "losses.json"), "w") as f:
            json.dump(losses, f)  # mean loss per step, broadcast from the last stage
    torch.distributed.destroy_process_group()


def run_deepspeed(model: str, contender: str, steps: int, warmup: int, folder: str) -> list[float]:
    """Seconds per optimizer step on rank 0 (from one step's end to the next's) after ``warmup``
    steps, as compare.py's other contenders report them; also leaves each step's mean
    loss in ``folder/losses.json`` for a correctness check against the torch contender."""
    if contender != "deepspeed_1f1b":
        raise ValueError(f"unknown DeepSpeed contender {contender!r}: DeepSpeed trains with 1F1B only (deepspeed_1f1b)")
    reason = available()
    if reason is not None:
        raise RuntimeError(reason)
    from workload import STAGES, free_port

    mp.start_processes(_worker, args=(model, steps, warmup, free_port(), folder), nprocs=STAGES, start_method="fork")
    with open(os.path.join(folder, "times.json")) as f:
        return json.load(f)
