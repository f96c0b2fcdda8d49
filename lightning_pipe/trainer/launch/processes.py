"""One process per device, set up as ``DDPStrategy`` sets its processes up, without DDP's model
wrapper and distributed sampler: the process-level half of ``PipelineStrategy``.

``is_distributed`` is False on purpose: a distributed strategy gets a ``DistributedSampler``
injected (which also reshuffles the training set), while every stage of a pipeline must see the
very batches the user's DataLoader yields, in the same order.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor

from lightning_pipe.trainer import internals, step_results
from lightning_pipe.trainer.launch import failures

default_timeout = timedelta(minutes=30)


class ProcessStrategy(ParallelStrategy):
    """The processes, the default process group and its collectives, as in ``DDPStrategy``."""

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_timeout,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """False so that Lightning keeps the user's sampler (see the module docstring)."""
        return False

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # an attribute Lightning sets on it
        self._process_group_backend = self._process_group_backend or internals.default_process_group_backend(
            self.root_device
        )
        assert self.cluster_environment is not None
        # bind the GPU for NCCL only (it creates the communicators eagerly); bound under gloo (two
        # stages sharing a GPU), torch's DeviceMesh splits the default group and fails copying gloo's options
        device_id = self.root_device if self._process_group_backend == "nccl" else None
        internals.init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        failures.start_heartbeat(self.global_rank)  # tells a lost rank from a living one when a peer fails
        step_results.quiet_moot_warnings()  # on every rank, before Lightning sets the data up

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return internals.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)
