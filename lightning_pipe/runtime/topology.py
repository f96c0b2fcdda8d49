"""Where each rank sits: pipeline stage x data-parallel replica.

The world of ``p x d`` processes is a ``DeviceMesh`` with dims ``("pp", "dp")``: by default rank
``r`` is stage ``r // d`` of replica ``r % d``, so the ``d`` replicas of one stage are neighbouring
ranks. Their gradient all-reduce (the heavy, frequent collective) then stays inside a node, while
the pipeline's point-to-point traffic is what crosses nodes. On unequal devices a layout may be
*placed* (:meth:`Layout.placed`): its slots (stage x replica) are held by the ranks of an ``order``
(see :mod:`lightning_pipe.partition.solvers.rank_order`), so that the replicas of a stage are equally fast.

:class:`Layout` is the arithmetic alone (no processes, tested as such); :class:`Topology` adds
the process groups of this rank, built once from the mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

DataParallelMode = Literal["replicate", "shard"]
DATA_PARALLEL_MODES: tuple[DataParallelMode, ...] = get_args(DataParallelMode)


def check_layout_arguments(stages: int | None, data_parallel: str) -> None:
    """Reject bad ``stages``/``data_parallel`` before any process starts."""
    if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool) or stages < 1):
        raise ValueError(
            f"PipelineStrategy(stages={stages!r}): stages is the pipeline depth and must be an integer >= 1, "
            "or None for one stage per process."
        )
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(
            f"PipelineStrategy(data_parallel={data_parallel!r}): unknown mode. Valid: {', '.join(DATA_PARALLEL_MODES)}."
        )


@dataclass(frozen=True)
class Layout:
    """``stages`` x ``replicas`` processes. Slot ``k`` is stage ``k // replicas`` of replica
    ``k % replicas``; rank ``order[k]`` holds it (``order`` empty: rank ``k``, the default)."""

    stages: int
    replicas: int
    order: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.order and sorted(self.order) != list(range(self.stages * self.replicas)):
            raise ValueError(
                f"a rank order of {self.stages} x {self.replicas} processes names each global rank "
                f"0..{self.stages * self.replicas - 1} once, got {list(self.order)}"
            )
        if self.order == tuple(range(len(self.order))):
            object.__setattr__(self, "order", ())  # the identity: one spelling, so equal layouts compare equal
        slots = {rank: slot for slot, rank in enumerate(self.order)}
        object.__setattr__(self, "_slots", slots)

    def placed(self, order: Sequence[int] | None) -> Layout:
        """This layout with slot ``k`` held by rank ``order[k]`` (None: by rank ``k``)."""
        return Layout(self.stages, self.replicas, tuple(order or ()))

    @property
    def is_placed(self) -> bool:
        """Whether some rank holds another slot than its own number."""
        return bool(self.order)

    def _slot(self, rank: int) -> int:
        return self._slots[rank] if self.order else rank  # type: ignore[attr-defined]  # set in __post_init__

    @classmethod
    def of(cls, world_size: int, stages: int | None) -> Layout:
        """The layout of ``world_size`` processes in pipelines of ``stages`` (None: one pipeline)."""
        if stages is None:
            return cls(world_size, 1)
        if world_size % stages != 0:
            raise ValueError(
                f"PipelineStrategy(stages={stages}) does not divide the world size {world_size} (devices x nodes): "
                f"the world must be stages x data-parallel replicas. Use a stages value that divides {world_size}, "
                f"or {stages} x k devices in all."
            )
        return cls(stages, world_size // stages)

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def stage_of(self, rank: int) -> int:
        return self._slot(rank) // self.replicas

    def replica_of(self, rank: int) -> int:
        return self._slot(rank) % self.replicas

    def rank(self, stage: int, replica: int) -> int:
        slot = stage * self.replicas + replica
        return self.order[slot] if self.order else slot

    def ranks(self) -> list[int]:
        """Every slot's rank, stage 0's replicas first (the mesh's rows)."""
        return list(self.order) if self.order else list(range(self.world_size))

    def pipeline_ranks(self, replica: int) -> list[int]:
        """Global ranks of replica ``replica``'s stages, first to last."""
        return [self.rank(s, replica) for s in range(self.stages)]

    def replica_ranks(self, stage: int) -> list[int]:
        """Global ranks holding stage ``stage``, one per replica."""
        return [self.rank(stage, j) for j in range(self.replicas)]


@dataclass(frozen=True)
class Placement:
    """Where this rank's part of the model runs: its place in the layout, the (virtual) stages it
    holds, and its device. A value handed down to the pipeline, built once the schedule (and so
    where each stage goes) is final.

    Attributes:
        layout: stages x replicas of the world.
        rank: this process's global rank.
        positions: for each stage of the split (``stages x virtual_stages`` of them), the pipeline
            position that holds it (see :func:`lightning_pipe.partition.stages.virtual.stage_positions`).
        device: this rank's device.
        backend: the default process group's backend (``"gloo"``, ``"nccl"``): how point-to-point
            messages are posted and whether tensors stage through host memory.
    """

    layout: Layout
    rank: int
    positions: tuple[int, ...]
    device: Any
    backend: str = "gloo"

    @property
    def stage(self) -> int:
        """This rank's position along its pipeline (its stage, where each process holds one)."""
        return self.layout.stage_of(self.rank)

    @property
    def replica(self) -> int:
        return self.layout.replica_of(self.rank)

    @property
    def num_stages(self) -> int:
        """Pipeline depth: processes per pipeline."""
        return self.layout.stages

    @property
    def num_replicas(self) -> int:
        return self.layout.replicas

    @property
    def pipeline_ranks(self) -> list[int]:
        """Global ranks of this pipeline's positions, first to last."""
        return self.layout.pipeline_ranks(self.replica)

    @property
    def local_stages(self) -> list[int]:
        """The stages of the split that this rank holds (one, or several for interleaved schedules)."""
        return [s for s, p in enumerate(self.positions) if p == self.stage]

    @property
    def stage_ranks(self) -> list[int]:
        """Global rank holding each stage of the split, in this rank's pipeline."""
        ranks = self.pipeline_ranks
        return [ranks[p] for p in self.positions]

    @property
    def last_position(self) -> int:
        """The position holding the last stage (with several stages per process not necessarily the
        last process: ZB-V's last stage is on the first)."""
        return self.positions[-1]

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last stage, where the user's step computes the loss."""
        return self.stage == self.last_position

    @property
    def rendezvous(self) -> bool:
        """Whether point-to-point calls rendezvous (NCCL): schedules must be regrouped for it."""
        return self.backend == "nccl"

    @property
    def through_host(self) -> bool:
        """gloo on GPUs (no NCCL, or two stages sharing a GPU to debug) sends through host memory."""
        return self.backend == "gloo" and getattr(self.device, "type", "cpu") != "cpu"

    def describe_rank(self, rank: int) -> str:
        """``rank r (stage s of p)``: how errors name a process."""
        return describe_rank(self.layout, rank)


def describe_rank(layout: Layout, rank: int) -> str:
    """``rank r (stage s of p[, replica j of d])``: how errors name a process."""
    where = f"stage {layout.stage_of(rank)} of {layout.stages}"
    if layout.replicas > 1:
        where += f", replica {layout.replica_of(rank)} of {layout.replicas}"
    return f"rank {rank} ({where})"


class Topology:
    """This rank's place in the layout and its process groups (every rank must build it: creating
    a group is collective).

    Attributes:
        mesh: the ``DeviceMesh`` with dims ``("pp", "dp")``.
        pp_group: this rank's pipeline (its column of the mesh).
        dp_group: the replicas of this rank's stage (its row of the mesh).
        meta_group: a gloo group over this rank's pipeline, for small host-side messages (activation
            headers, sample indices, step summaries), whatever the backend of ``pp_group``.
        meta_src: global rank of this pipeline's first stage (the source of its sample order).
        gather_group: a gloo group over rank 0 and replica 0's pipeline, where rank 0 receives the
            whole weights from replica 0 wherever it sits (None on the ranks outside it). Replica 0's
            weights are the checkpoint's: under ``replicas_sync="elastic"`` the replicas differ.
        backend: the default group's backend (``"gloo"``, ``"nccl"``).
    """

    def __init__(self, layout: Layout, rank: int, device_type: str) -> None:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        self.layout = layout
        self.rank = rank
        self.stage = layout.stage_of(rank)
        self.replica = layout.replica_of(rank)
        self.backend = dist.get_backend()
        if layout.is_placed:  # rows by stage, as placed
            mesh = torch.tensor(layout.ranks(), dtype=torch.int).view(layout.stages, layout.replicas)
            self.mesh = DeviceMesh(device_type, mesh, mesh_dim_names=("pp", "dp"))
        else:
            self.mesh = init_device_mesh(device_type, (layout.stages, layout.replicas), mesh_dim_names=("pp", "dp"))
        self.pp_group = self.mesh.get_group("pp")
        self.dp_group = self.mesh.get_group("dp")
        gloo = dist.get_backend() == "gloo"
        meta_groups = [  # every rank creates every replica's, in the same order
            dist.new_group() if gloo and layout.replicas == 1 else dist.new_group(ranks, backend="gloo")
            for ranks in map(layout.pipeline_ranks, range(layout.replicas))
        ]
        self.meta_group: ProcessGroup = meta_groups[self.replica]
        self.pipeline_ranks = layout.pipeline_ranks(self.replica)
        self.meta_src = self.pipeline_ranks[0]
        first = layout.pipeline_ranks(0)
        if 0 in first:  # rank 0 is in replica 0: its pipeline's group
            self.gather_group: ProcessGroup | None = self.meta_group if self.replica == 0 else None
        else:  # placed into another replica (rank_order): one more group, created by every rank
            group = dist.new_group(sorted({0, *first}), backend="gloo")
            self.gather_group = group if rank == 0 or self.replica == 0 else None
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}

    def group(self, ranks: Sequence[int]) -> ProcessGroup:
        """The process group of ``ranks``, created on first use. Creating a group is collective:
        every rank asks for the same groups in the same order (a second setup, such as test after
        fit, creates none)."""
        key = tuple(ranks)
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key))
        return self._groups[key]
