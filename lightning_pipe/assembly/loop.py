"""``PlainPipeline``: this rank's pipeline driven by whole batches from a plain PyTorch loop.

A step function takes one micro-batch and returns its loss (``lambda batch: F.mse_loss(model(batch[0]),
batch[1])``); it runs unchanged on every rank, and ``model(...)`` inside it runs this rank's stages
(the first stage's input comes from the call, the others' from the previous stage). The verbs split
the batch into micro-batches, weight each loss by its share of the batch (or of ``loss_weight``'s
count), and give every rank the batch's loss, so a loop reads the same numbers wherever it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe.assembly.split import ModuleSplit
from lightning_pipe.checkpoint import optimizer_state_by_name, optimizer_state_by_position, parameter_names, stage_io
from lightning_pipe.runtime.loss_weights import LossWeight, microbatch_shares
from lightning_pipe.runtime.microbatch import batch_size, signature, split, tensors_of
from lightning_pipe.runtime.pipeline import StagePipeline
from lightning_pipe.runtime.topology import Topology

#: One micro-batch in, its loss out (a scalar tensor; its value matters on the last stage only).
LossFn = Callable[[Any], Tensor]


class PlainPipeline:
    """This rank's share of the pipeline (built by :func:`lightning_pipe.build_pipeline`).

    Attributes:
        module: the user's module, holding only this rank's stages under their original names.
        pipeline: the :class:`~lightning_pipe.runtime.pipeline.StagePipeline` underneath.
        placement: where this rank's stages sit (``placement.stage``, ``placement.is_last_stage``, ...).
    """

    def __init__(self, module: nn.Module, split: ModuleSplit, topology: Topology, pipeline: StagePipeline) -> None:
        self.module, self.pipeline, self.placement = module, pipeline, pipeline.placement
        self.config = split.config
        self._split, self._topology = split, topology
        self._steps = 0
        self._attached = False

    def attach_optimizers(self, *optimizers: Optimizer) -> None:
        """The optimizers that step this rank's parameters: ``replicas_sync="elastic"`` averages the
        replicas after their steps and PipeMare's rescheduling follows their learning rates."""
        self.pipeline.attach_optimizers(optimizers)
        self._attached = True

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters: what its optimizer steps."""
        return self.module.parameters()

    # ------------------------------------------------------------------ steps
    def train_step(self, batch: Any, loss_fn: LossFn) -> Tensor:
        """Forward and backward of ``batch`` through the schedule; the gradients are added to ``.grad``
        (as ``loss.backward()`` adds them) and the batch's loss is returned on every rank."""
        if not self._attached and self._follows_optimizers():
            raise RuntimeError(
                f"schedule={self.config.schedule!r} with replicas_sync={self.config.replicas_sync!r} acts after each "
                "optimizer step: call pipe.attach_optimizers(optimizer) once the optimizer exists, before training."
            )
        micro, keys, weights = self._begin(batch)
        ends = self.pipeline.ends_here(len(micro))  # where each micro-batch's loss is computed
        total: list[Tensor] = []

        def step(i: int) -> Tensor | None:
            loss = loss_fn(micro[i])
            if not ends[i]:
                return None
            total.append(loss.detach() * weights[i])
            return loss * weights[i]

        self.pipeline.train_step(keys, step)
        self.pipeline.hand_over_gradients()
        self._steps += 1
        return self._shared(total)

    def evaluate(self, batch: Any, loss_fn: LossFn) -> Tensor:
        """Forward only, without gradients; the batch's loss (weighted as in training) on every rank."""
        self.pipeline.drain()  # an asynchronous schedule's backwards in flight
        micro, keys, weights = self._begin(batch)
        total: list[Tensor] = []

        def step(i: int) -> None:
            loss = loss_fn(micro[i])  # returns only where the micro-batch's last stage runs
            total.append(loss.detach() * weights[i])

        with torch.no_grad():
            self.pipeline.evaluate(keys, step)
        return self._shared(total)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this rank's gradients by the 2-norm over every stage's;
        returns that norm on every rank."""
        return self.pipeline.clip_grad_norm_(list(self.module.parameters()), max_norm)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path, optimizers: Sequence[Optimizer] = (), **extra: Any) -> None:
        """Write the project's checkpoint directory at ``path`` (every rank its stage's file, rank 0 the
        metadata with ``extra``, such as ``global_step=``); every rank calls it. ``lightning-pipe-checkpoint
        consolidate`` or :func:`lightning_pipe.checkpoint.consolidate` makes the unsplit module's file from it."""
        self.pipeline.drain()
        names, aliases = parameter_names(self.module), self._split.optimizer_aliases()
        checkpoint: dict[str, Any] = {**extra, "state_dict": self.module.state_dict()}
        if optimizers:
            checkpoint["optimizer_states"] = [optimizer_state_by_name(o, names, aliases) for o in optimizers]
        writer = self._split.writer(self._topology, dist.get_rank() == 0, broadcast, dist.barrier)
        state = self.pipeline.state_dict()
        async_state = None if state is None else state if "elastic" in state else {"async": state}
        stage_io.save(checkpoint, Path(path), writer, async_state)

    def load(self, path: str | Path, optimizers: Sequence[Optimizer] = ()) -> dict[str, Any]:
        """Read this rank's stage from a checkpoint directory written under any layout (or a plain
        ``torch.save`` of ``{"state_dict": ...}``); returns what else it holds (``extra`` of :meth:`save`)."""
        local = list(self.module.state_dict())
        checkpoint, async_state = stage_io.load(path, local, True, lambda p, w: torch.load(p, weights_only=w))
        self.module.load_state_dict(checkpoint.pop("state_dict"))
        names = parameter_names(self.module)
        for optimizer, named in zip(optimizers, checkpoint.pop("optimizer_states", None) or []):
            order = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
            optimizer.load_state_dict(optimizer_state_by_position(named, order))
        self.pipeline.load_state_dict(async_state)
        return checkpoint

    def close(self) -> None:
        """Finish what is in flight and give the layers back their own forwards."""
        self.pipeline.drain()
        self.pipeline.close()

    def __enter__(self) -> PlainPipeline:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _follows_optimizers(self) -> bool:
        """Whether the pipeline acts after each optimizer step (elastic averaging, PipeMare's rescheduling)."""
        run = self.pipeline.asynchronous
        return self.pipeline.elastic is not None or (run is not None and run.pipemare is not None)

    def _begin(self, batch: Any) -> tuple[list[Any], list[tuple], list[float]]:
        """The batch's micro-batches, their shape keys (checked against the other stages', and the
        values' checksum by ``check_data``) and each one's share of the batch's loss."""
        micro = split(batch, self.pipeline.microbatches_for(batch_size(batch)))
        keys = [signature(mb) for mb in micro]
        check = self.config.check_data
        values = check is True or (check is not False and self._steps % int(check) == 0)
        self.pipeline.agree(keys, tensors_of(batch) if values else None, "the batch handed to the step")
        chosen = self.config.loss_weight
        loss_weight = None if chosen in (None, "samples") else cast("LossWeight", chosen)
        weights, _ = microbatch_shares(micro, loss_weight)
        return micro, keys, weights

    def _shared(self, losses: list[Tensor]) -> Tensor:
        """The batch's loss, from the ranks that computed it, on every rank; with replicas, their mean."""
        device = self.placement.device
        value = torch.stack([t.float().to(device) for t in losses]).sum() if losses else torch.zeros((), device=device)
        if self.placement.num_stages > 1:
            dist.all_reduce(value, group=self._topology.pp_group)  # the loss ranks' parts (two under Chimera)
        if self.placement.num_replicas > 1:
            dist.all_reduce(value, group=self._topology.dp_group)
            value /= self.placement.num_replicas
        return value


def broadcast(value: Any) -> Any:
    """Global rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
