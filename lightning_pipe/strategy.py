"""``PipelineStrategy``: thin glue between Lightning's Trainer and :mod:`lightning_pipe.runtime`.

The Trainer calls ``training_step`` once per batch; this strategy splits the batch, runs the
whole schedule (every micro-batch's forward and backward) inside that call, and keeps the
gradients it produced away from the ``zero_grad`` Lightning runs between ``training_step`` and
``backward``; ``backward`` then hands them to the parameters. Everything else (launching, the
process group, optimizers, loops, callbacks) is Lightning's own, as in ``DDPStrategy``.

The strategy reports ``is_distributed = False`` to Lightning on purpose: a distributed strategy
gets a ``DistributedSampler`` injected (which also reshuffles the training set), while every stage
of a pipeline must see the very batches the user's DataLoader yields, in the same order.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Generator, Literal, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe.checkpoint import optimizer_state_by_name, optimizer_state_by_position, parameter_names, stage_io, tie_aliases
from lightning_pipe import failures
from lightning_pipe.arguments import check_arguments
from lightning_pipe.compatibility import check_async, check_shard, run_schedule
from lightning_pipe.gradients import StageGradients, Tie, swap_grads, tie_groups
from lightning_pipe.launcher import PipelineMultiProcessingLauncher, PipelineScriptLauncher
from lightning_pipe.partition import find_sequential, resolve_balance, tied_parameters
from lightning_pipe.partition.costs import MEASURED_BALANCES, Profile
from lightning_pipe.partition.materialize import has_meta_tensors, materialize
from lightning_pipe.partition.split import BalanceSpec, stage_bounds
from lightning_pipe.plan.auto import apply_plan
from lightning_pipe.partition.measured import measured_balance
from lightning_pipe.precision import sync_gradient_scaler
from lightning_pipe.run_report import describe_layout
from lightning_pipe.runtime.agreement import BatchAgreement
from lightning_pipe.runtime.async_pipeline import AsyncPipeline
from lightning_pipe.runtime import deferred_conv, fused_linear
from lightning_pipe.runtime.executor import Executor
from lightning_pipe.runtime.microbatch import batch_size, merge, signature, split, tensors_of
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sampling import share_order
from lightning_pipe.runtime.stage import StageModule, StageRunner
from lightning_pipe.runtime.replica_data import EMPTY, combine_over_replicas, is_padding, split_over_replicas
from lightning_pipe.runtime.sharding import ShardedStage, is_dtensor, shard_like
from lightning_pipe.runtime.timeline import Timeline
from lightning_pipe.runtime.topology import Layout, Topology
from lightning_pipe.runtime.versions import WeightVersions
from lightning_pipe.partition.virtual import split_stages, stage_positions, ties_by_position
from lightning_pipe.schedules import VIRTUAL_STAGES, Schedule, is_async
from lightning_pipe.schedules.interleaved import ROUNDED, valid_microbatches
from lightning_pipe import signals
from lightning_pipe.step_results import StepRecorder, SummarySharing, replay, step_loss
from lightning_pipe.weights import load_stage_weights, model_spec

log = logging.getLogger(__name__)

_default_timeout = timedelta(minutes=30)
_LOADERS = {  # step kind -> (name in messages, Trainer attribute holding its DataLoader)
    "train": ("training", "train_dataloader"),
    "validation_step": ("validation", "val_dataloaders"),
    "test_step": ("test", "test_dataloaders"),
    "predict_step": ("predict", "predict_dataloaders"),
}


class PipelineStrategy(ParallelStrategy):
    """Pipeline model parallelism: one stage of the module's ``nn.Sequential`` per process.

    Args:
        schedule: micro-batch order: ``"gpipe"``, ``"1f1b"``, ``"zero_bubble"`` (ZB-H1: each backward
            split into the input gradient and, later, the weight gradient), or an asynchronous one.
        chunks: micro-batches per batch (default: twice the number of stages). A batch smaller than
            ``chunks`` is split into as many micro-batches as it has samples.
        balance: how layers are assigned to stages: ``"uniform"`` (equal layer counts),
            ``"parameters"`` (equal parameter counts), ``"time"`` / ``"memory"`` (the least slowest /
            largest stage, from a profile measured on the device before the split, identical on every
            rank; kept in ``strategy.profile``) or a list of layer counts per stage.
        checkpoint: activation recomputation: ``"always"``, ``"except_last"`` (every micro-batch but
            the last) or ``"never"``.
        module: name of the ``nn.Sequential`` attribute to split, if the module has several.
        start_method: how processes start, as in ``DDPStrategy``: ``"popen"`` (scripts and the CLI),
            ``"spawn"`` or ``"fork"`` (notebooks and tests).
        gradient_accumulation_fusion: in training steps, the backward of each plain ``nn.Linear``
            adds its weight gradient into ``.grad`` within the matrix product instead of computing
            each micro-batch's gradient apart and adding it (same gradients, less memory traffic;
            see :mod:`lightning_pipe.runtime.fused_linear`).
        virtual_stages: stages per process for ``"interleaved_1f1b"`` and ``"interleaved_zero_bubble"``
            (>= 2, default 2) and ``"zbv"`` (2); the layers are split into processes x virtual_stages stages by ``balance``.
        weights: full weights to start from (``.pt``/``.pth`` state_dict, Lightning ``.ckpt``,
            ``.safetensors`` or a lightning-pipe checkpoint directory); each rank reads only its
            stage's tensors (see :mod:`lightning_pipe.weights`).
        check_data: when the stages compare a checksum of the batch they loaded (they compare its
            shapes every step): ``True`` every step, an integer ``N`` every ``N`` steps and at the
            first step of each epoch and evaluation loop, ``False`` never (see
            :mod:`lightning_pipe.runtime.agreement`).
        plan: ``"auto"`` to let the planner choose ``schedule`` (among the synchronous ones),
            ``virtual_stages``, ``chunks``, ``balance`` and ``checkpoint`` from a profile of the layers
            and the measured point-to-point link, before the split (see :mod:`lightning_pipe.plan.planner`);
            ``stages`` (and so the replicas) stays as given. The ranked candidates are kept in
            ``strategy.plan_candidates``. ``None`` (default): as given.
        stages: pipeline depth p (default: one stage per process). The world (devices x nodes) must be
            p x d: d replicas of the pipeline train together, each on its own part of every step.
        data_parallel: how the replicas of a stage share it: ``"replicate"`` (whole copies, gradients
            averaged over the replicas) or ``"shard"`` (FSDP2 over the replicas).

    A module that builds its layers in ``configure_model()`` (or under
    ``trainer.init_module(empty_init=True)``) is built on the meta device; each rank gives storage
    only to its stage and to the parameters outside the split Sequential, initialised layer by layer
    from the run's seed (see :mod:`lightning_pipe.partition.materialize`).
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        schedule: str = "1f1b",
        chunks: Optional[int] = None,
        balance: BalanceSpec = "uniform",
        checkpoint: str = "never",
        module: Optional[str] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = _default_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        gradient_accumulation_fusion: bool = True,
        virtual_stages: Optional[int] = None,
        check_data: Union[bool, int] = True,
        weights: Optional[Union[str, Path]] = None,
        plan: Optional[str] = None,
        stages: Optional[int] = None,
        data_parallel: str = "replicate",
    ) -> None:
        check_arguments(
            schedule, chunks, balance, checkpoint, weights, virtual_stages,
            stages=stages, data_parallel=data_parallel, plan=plan, check_data=check_data,
        )  # fmt: skip
        self.plan = plan
        self.plan_candidates: Optional[list[Any]] = None  # plan="auto": the ranked layouts, the first one runs
        self.plan_all_layouts = False  # `lightning-pipe plan`: rank every stages x replicas of the world too
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
        self._start_method = start_method
        self.schedule_name = schedule
        self.chunks = chunks
        self.balance = balance
        self.checkpoint_mode = checkpoint
        self.module_name = module
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.virtual_stages = virtual_stages if virtual_stages is not None else VIRTUAL_STAGES.get(schedule, 1)
        self._positions: Optional[list[int]] = None  # pipeline position holding each (virtual) stage
        self._stages: dict[int, StageModule] = {}
        self.check_data = check_data
        self.stages = stages
        self.data_parallel = data_parallel
        self._topology: Optional[Topology] = None
        self._sharded: Optional[ShardedStage] = None
        self.weights = weights
        self.deferred_build = False  # the module was built on the meta device
        self._fused_layers: list[nn.Module] = []
        self._stage_module: Optional[StageModule] = None
        self._runner: Optional[StageRunner] = None
        self._executor: Optional[Executor] = None
        self._schedules: dict[tuple[str, int], Schedule] = {}
        self._gradients: Optional[StageGradients] = None
        self._shared: list[nn.Parameter] = []
        self._ties: list[dict[int, str]] = []  # weights shared by layers of different stages
        self._tie_groups: Optional[list[Tie]] = None
        self._meta_group: Any = None
        self._agreement: Optional[BatchAgreement] = None
        self._scaler: Optional[torch.amp.GradScaler] = None
        self._async: Optional[AsyncPipeline] = None
        self._sharing: Optional[SummarySharing] = None  # the last stage's summaries, on every rank
        self._last_loss = float("nan")
        self.stage_balance: Optional[list[int]] = None
        self.profile: Optional[Profile] = None  # balance="time"/"memory": the measured layer costs
        self._signals: Optional[signals.PipelineSignalConnector] = None

    # ------------------------------------------------------------------ processes (as DDPStrategy)
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
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )

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

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds on the meta device; ``setup`` materialises the stage."""
        with torch.device("meta") if empty_init else super().tensor_init_context(empty_init):
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model()`` builds on the meta device; ``setup`` materialises the stage."""
        with torch.device("meta"):
            yield

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def process_dataloader(self, dataloader: object) -> object:
        """Make every stage of the pipeline draw the first stage's indices: each stage loads the
        batch itself, and a sampler drawing from a process's random state would differ between them
        (see :mod:`lightning_pipe.runtime.sampling`)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.num_replicas > 1 and trainer is not None and not trainer.predicting:
            # each replica its own part of every step; predict runs every sample on every replica
            dataloader = split_over_replicas(dataloader, self.num_replicas, self.replica, trainer.state.stage)
        return share_order(dataloader, self._meta_group, self.pipeline_ranks[0], self.pipeline_ranks)

    # ------------------------------------------------------------------ topology
    @property
    def layout(self) -> Layout:
        """Stages x replicas of the world (raises, naming both numbers, where ``stages`` does not divide it)."""
        return Layout.of(self.num_nodes * self.num_processes, self.stages)

    @property
    def num_stages(self) -> int:
        return self.layout.stages

    @property
    def num_replicas(self) -> int:
        return self.layout.replicas

    @property
    def stage(self) -> int:
        return self.layout.stage_of(self.global_rank)

    @property
    def replica(self) -> int:
        return self.layout.replica_of(self.global_rank)

    @property
    def pipeline_ranks(self) -> list[int]:
        """Global ranks of this pipeline's stages, first to last."""
        return self.layout.pipeline_ranks(self.replica)

    @property
    def is_last_stage(self) -> bool:
        """Whether this process holds the last stage (with several stages per process, not
        necessarily the last process: ZB-V's last stage is on the first)."""
        return self.stage == self._last_position

    @property
    def _last_position(self) -> int:
        return self._positions[-1] if self._positions is not None else self.num_stages - 1

    @property
    def num_microbatches(self) -> int:
        return self.chunks if self.chunks is not None else 2 * self.num_stages

    def enable_timeline(self, keep: Optional[int] = None) -> Timeline:
        """Record, from the next step on, when each forward, backward, communication post and wait
        ran on this rank (CUDA events on a GPU): ``timeline.totals()`` gives seconds per step by kind,
        ``timeline.steps`` every span. Call it once the Trainer has set the strategy up (for example
        in a callback's ``on_fit_start``).

        Callers share one timeline: a second call returns the one already recording. ``keep``
        (steps to keep in ``timeline.steps``; None: all) is the most any caller asked for."""
        if self._executor is None:
            raise RuntimeError(
                "The pipeline is not set up yet. Call enable_timeline() once the Trainer has set up the "
                "strategy, for example in a callback's on_fit_start."
            )
        timeline = self._executor.timeline
        if timeline is None:
            timeline = self._executor.timeline = Timeline(self.root_device, keep)
        elif timeline.keep is not None:
            timeline.keep = None if keep is None else max(keep, timeline.keep)
        return timeline

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.layout  # a world size that `stages` does not divide fails here, before any process starts
        if self._start_method == "popen":
            self._launcher = PipelineScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = PipelineMultiProcessingLauncher(self, start_method=self._start_method)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._signals = signals.install(trainer)
        module = self.lightning_module
        assert module is not None
        if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
            raise MisconfigurationException(
                "PipelineStrategy runs the backward itself, so it supports automatic optimization only. "
                "Remove `self.automatic_optimization = False` from the LightningModule."
            )
        self._split(module)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._setup_pipeline()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._patch_gradient_clipping()
        self._scaler = getattr(self.precision_plugin, "scaler", None)
        if self._scaler is not None:
            sync_gradient_scaler(self._scaler)

    def _split(self, module: "pl.LightningModule") -> None:
        """Replace the Sequential by this rank's stage, under the same attribute and layer names."""
        name, layers = find_sequential(module, self.module_name)
        if isinstance(layers, StageModule):  # set up before (fit, then test): already split
            self._stage_module = layers
            return
        if self.plan == "auto" and self.num_stages > 1 and self.plan_candidates is None:
            apply_plan(self, module, layers)
        virtual = self.virtual_stages if self.schedule_name in VIRTUAL_STAGES else 1
        positions = stage_positions(self.schedule_name, self.num_stages, virtual)
        if self.balance in MEASURED_BALANCES and len(positions) > 1:
            balance = measured_balance(self, module, layers, virtual)
        elif self.balance in MEASURED_BALANCES:
            balance = [len(layers)]
        else:
            balance = resolve_balance(self.balance, layers, len(positions))
        self.stage_balance = balance
        self._ties = ties_by_position(tied_parameters(layers, balance), positions)
        spec = model_spec(module) if self.weights is not None else None
        stage, self._stages = split_stages(layers, balance, positions, self.stage)
        self._positions = positions
        if has_meta_tensors(module):
            self.deferred_build = True
            bounds = stage_bounds(balance)
            local = [i for s in sorted(self._stages) for i in range(*bounds[s])]
            materialize(module, layers, local, self.root_device)
        setattr(module, name, stage)
        if spec is not None:
            load_stage_weights(module, self.weights, spec)
        self._stage_module = stage
        self.module_name = name
        if self.global_rank == 0:  # where Lightning prints its own setup lines, in any script
            rank_zero_info(describe_layout(
                module.trainer, self.num_stages, self.num_replicas, balance, positions, self.schedule_name,
                self.num_microbatches,
            ))  # fmt: skip

    def _setup_pipeline(self) -> None:
        module = self.lightning_module
        assert module is not None and self._stage_module is not None
        prefix = f"{self.module_name}."
        self._shared = [p for n, p in sorted(module.named_parameters()) if not n.startswith(prefix)]
        if self._topology is None:
            self._topology = Topology(self.layout, self.global_rank, self.root_device.type)
            self._meta_group = self._topology.meta_group
        topology = self._topology
        if self._tie_groups is None:
            self._tie_groups = tie_groups(
                self._ties, self.layout.rank, self.num_replicas, self.stage, self.replica, self._stage_module
            )
        if self._gradients is not None:
            self._gradients.close()
        if self.sharded and self._sharded is None:
            check_shard(self.schedule_name, self._shared, bool(self._ties))
            self._sharded = ShardedStage(self._stage_module, topology.mesh["dp"])
        self._gradients = StageGradients(
            self._shared,
            self._tie_groups,
            topology.pp_group,
            self.num_stages,
            counts_shared=self.stage == 0,
            norm_group=None if self.sharded else topology.pp_group,  # shards: every rank holds its own part
            dp_group=topology.dp_group if self.num_replicas > 1 and not self.sharded else None,
        )
        positions = self._positions or list(range(self.num_stages))
        transport = Transport(
            stage_ranks=[self.pipeline_ranks[p] for p in positions],
            device=self.root_device,
            group=None,
            meta_group=self._meta_group,
            batched=dist.get_backend() == "nccl",
            through_host=self._stages_through_host(),
        )
        versions = None
        if is_async(self.schedule_name):
            check_async(
                self.schedule_name, module, self._shared, bool(self._ties), self.num_stages, self.num_microbatches,
                getattr(self.precision_plugin, "scaler", None),
            )
            versions = WeightVersions(self._stage_module)
        if self.num_stages > 1:
            self._agreement = BatchAgreement(self._meta_group, self.num_stages)
        split = not is_async(self.schedule_name) and self._schedule(self.schedule_name, self.num_microbatches).split_backward
        if self._sharded is not None:
            pass  # FSDP2 accumulates the micro-batches' gradients itself
        elif split:  # W is these layers' deferred work
            self._fused_layers = deferred_conv.install_split(self._stage_module)
        elif self.gradient_accumulation_fusion:
            self._fused_layers = fused_linear.install(self._stage_module)
        if versions is None and self._sharded is None and not split:
            # the readiness hooks fire in B, while deferred weight gradients are complete only after
            # W: a split backward's replicas average after the step's last W
            self._gradients.overlap(list(module.parameters()))
        stages = self._stages or {self.stage: self._stage_module}
        runners = {
            s: StageRunner(m, checkpoint=self.checkpoint_mode, versions=versions, host=self._stage_module)
            for s, m in stages.items()
        }
        self._runner = runners[min(runners)]
        self._executor = Executor(transport, runners, rank=self.stage)
        if versions is not None:
            self._async = AsyncPipeline(self.schedule_name, self._executor, self._runner, self.num_stages)

    @property
    def sharded(self) -> bool:
        """Whether each stage is sharded over its replicas (FSDP2)."""
        return self.data_parallel == "shard" and self.num_replicas > 1

    def _stages_through_host(self) -> bool:
        """gloo on GPUs (no NCCL, or two stages sharing a GPU to debug) sends through host memory."""
        return dist.get_backend() == "gloo" and self.root_device.type != "cpu"

    def _schedule(self, name: str, num_microbatches: int) -> Schedule:
        """The schedule for ``num_microbatches``, proven to finish on this process group."""
        key = (name, num_microbatches)
        if key not in self._schedules:
            rendezvous = dist.is_initialized() and dist.get_backend() == "nccl"
            self._schedules[key] = run_schedule(
                self.schedule_name, name, self.num_stages, num_microbatches, self.virtual_stages, rendezvous
            )
        return self._schedules[key]

    def _set_step(self, step: Optional[Callable[[int], Optional[Tensor]]]) -> None:
        assert self._executor is not None
        for runner in self._executor.runners.values():
            runner.step = step

    def _chunks_for(self, batch: Any) -> int:
        """Micro-batches for ``batch``: ``chunks``, or for interleaving the most it can round
        (a short last batch)."""
        if self.schedule_name not in ROUNDED:
            return self.num_microbatches
        return valid_microbatches(self.num_stages, max(1, min(self.num_microbatches, batch_size(batch))))

    # ------------------------------------------------------------------ steps
    def _begin_step(
        self, kind: str, args: tuple
    ) -> tuple["pl.LightningModule", list[Any], list[tuple], list[float], StepRecorder]:
        """The module, the batch's micro-batches, their shape keys, their weights (share of the
        batch's samples) and a recorder for what the step logs. Starts checking that every stage
        loaded the same batch (finished before this rank's first receive)."""
        module = self.lightning_module
        assert module is not None and self._executor is not None and self._runner is not None
        batch = args[0]
        micro = split(batch, self._chunks_for(batch))
        keys = [signature(mb) for mb in micro]
        if self._agreement is not None:
            batch_idx = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
            loader_idx = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            if self._checks_values(batch_idx):
                trainer = module.trainer
                at = (trainer.current_epoch, trainer.global_step) if kind == "train" else None  # as the step began
                source = lambda: self._data_source(kind, batch_idx, loader_idx, at)
                self._agreement.post(keys, tensors_of(batch), source)
            else:
                self._agreement.post(keys)
            self._executor.transport.before_receive = self._agreement.check
        sizes = [batch_size(mb) for mb in micro]
        total = float(sum(sizes))
        weights = [n / total for n in sizes] if total else [1.0]  # an empty batch: one empty micro-batch
        return module, micro, keys, weights, StepRecorder()

    def _checks_values(self, batch_idx: int) -> bool:
        """Whether this step's fingerprint carries a checksum of the batch's values: every step by
        default, every N steps (and the first of each epoch and loop) with ``check_data=N``."""
        every = self.check_data
        return every is True or (every is not False and (batch_idx == 0 or batch_idx % every == 0))

    def _data_source(
        self, kind: str, batch_idx: int, loader_idx: int = 0, at: Optional[tuple[int, int]] = None
    ) -> str:
        """The DataLoader a step's batch came from and where in it (``at``: the training step's epoch
        and global step), named for an error message (formatted only when the stages disagree)."""
        name, attribute = _LOADERS[kind]
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        loader = getattr(trainer, attribute, None)
        if isinstance(loader, (list, tuple)) and loader:
            loader = loader[min(loader_idx, len(loader) - 1)]
        dataset = getattr(loader, "dataset", None)
        where = f"the {name} DataLoader" + (f" (dataset {type(dataset).__name__})" if dataset is not None else "")
        where += f" at batch {batch_idx}"
        if at is not None:
            where += f" of epoch {at[0]} (global step {at[1]})"
        every = self.check_data
        if every is not True and every > 1 and batch_idx > 0:  # check_data=N: last compared N batches ago
            where += f", compared every {every} batches, so they may differ from batch {batch_idx - every + 1} on"
        return where

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._signals is not None:  # after a SIGTERM, every stage stops here at the same step
            self._signals.stop_if_requested()
        module, micro, keys, weights, recorder = self._begin_step("train", args)
        rest, keep = args[1:], self.is_last_stage

        def step(i: int) -> Optional[Tensor]:
            weight = weights[i]
            with recorder.capture(module, weight, keep):
                output = module.training_step(micro[i], *rest, **kwargs)
            if not keep:
                return None
            loss = step_loss(output)
            if loss is None:
                raise RuntimeError(
                    "training_step returned None for a micro-batch. Under the pipeline every micro-batch must "
                    "return its loss; skipping a batch is not supported."
                )
            if torch.is_anomaly_enabled() and not bool(torch.isfinite(loss.detach()).all()):
                raise FloatingPointError(
                    f"training_step returned a loss of {loss.detach().float().item()} for micro-batch {i} of {len(micro)} "
                    f"(batch {rest[0] if rest else '?'}, global step {module.trainer.global_step}) on "
                    f"{self.describe_rank(self.global_rank)}; stopping because Trainer(detect_anomaly=True)."
                )
            recorder.add_loss(loss, weight)
            scaled = loss * weight
            return self._scaler.scale(scaled) if self._scaler is not None else scaled

        self._set_step(step)
        if self._async is not None:
            try:
                return self._async_training_step(module, micro, keys, recorder, rest[0] if rest else 0)
            finally:
                self._set_step(None)
        saved = swap_grads(module, {})
        self._gradients.begin(len(micro))  # this step's count of micro-batches: each expects its gradients
        if self._sharded is not None:
            self._sharded.begin()
        try:
            with self.precision_plugin.train_step_context(), self._accumulation():
                self._executor.run(self._schedule(self.schedule_name, len(micro)), keys)
            self._executor.transport.pass_gate()  # a rank with nothing to receive checks the shapes here
            if self._sharded is not None:
                self._sharded.finish()  # one reduce-scatter of the step's gradients
        finally:
            self._gradients.take(module, saved)
            self._set_step(None)
        summary = self._share("train", recorder)
        replay(module, summary, self.root_device)
        recorder.log_local(module)
        return torch.tensor(summary["loss"], device=self.root_device)

    def _accumulation(self) -> ContextManager[Any]:
        return fused_linear.accumulating(self.gradient_accumulation_fusion) if self._fused_layers else nullcontext()

    def _async_training_step(
        self, module: "pl.LightningModule", micro: list, keys: list[tuple], recorder: StepRecorder, batch_idx: int
    ) -> Tensor:
        """One step of an asynchronous schedule: this batch's forwards and the backwards due now;
        the gradient applied by this step's optimizer update is that of an earlier batch."""
        assert self._async is not None and self._stage_module is not None
        trainer = module.trainer
        if trainer.accumulate_grad_batches != 1:
            raise MisconfigurationException(
                f"schedule={self.schedule_name!r} applies one batch's gradient per optimizer step; "
                "accumulate_grad_batches must be 1 (raise `chunks` for larger batches instead)."
            )
        m = len(micro)
        fresh = not self._async.in_flight
        first = self._async.step * m
        with self.precision_plugin.train_step_context(), self._accumulation():
            t = self._async.train_step(m, {first + i: key for i, key in enumerate(keys)})
            self._executor.transport.pass_gate()
            isolated = self._async.isolated(m)
            sync = fresh or isolated or self._async_sync_point(trainer, batch_idx)
            if isolated or (sync and not fresh):
                self._async.drain()
        params = dict(self._stage_module.named_parameters())
        self._gradients.keep({params[name]: grad for name, grad in self._async.due(t, m).items()})
        # Logged values reach the other ranks a step late, so that no rank waits between steps;
        # where the pipeline starts or drains anyway, they are shared at once.
        summary = self._summary(recorder) if self.is_last_stage else None
        if self.num_stages == 1:
            assert summary is not None
            self._replay_summary(module, summary)
        else:
            lagged = self._summaries().take_lagged()
            if lagged is not None:
                self._replay_summary(module, lagged)
            if sync:
                self._replay_summary(module, self._summaries().share("train", summary))
            else:
                self._summaries().post_lagged(summary)
        recorder.log_local(module)
        return torch.tensor(self._last_loss, device=self.root_device)

    def _replay_summary(self, module: "pl.LightningModule", summary: dict[str, Any]) -> None:
        replay(module, summary, self.root_device)
        if summary["loss"] is not None:
            self._last_loss = summary["loss"]

    def _async_sync_point(self, trainer: "pl.Trainer", batch_idx: int) -> bool:
        """Whether training pauses after this step (epoch end, ``max_steps``): drain now."""
        loop = trainer.fit_loop.epoch_loop
        if loop.batch_progress.is_last_batch or batch_idx + 1 >= trainer.num_training_batches:
            return True
        return 0 < trainer.max_steps <= trainer.global_step + 1

    def on_validation_start(self) -> None:
        self._finish_pending()
        self._drain()

    def describe_rank(self, rank: int) -> str:
        """``rank r (stage s of p)``: how errors name a process."""
        layout = self.layout
        where = f"stage {layout.stage_of(rank)} of {layout.stages}"
        if layout.replicas > 1:
            where += f", replica {layout.replica_of(rank)} of {layout.replicas}"
        return f"rank {rank} ({where})"

    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks why this one fails, or explain a communication error with the note
        of the rank that failed first (see :mod:`lightning_pipe.failures`)."""
        explained = failures.report(exception, self.global_rank, self.describe_rank)
        if explained is None:
            return
        message = f"lightning-pipe: {explained}"
        if hasattr(exception, "add_note"):
            exception.add_note(message)
        else:  # Python 3.10
            log.error(message)

    def teardown(self) -> None:
        if dist.is_available() and dist.is_initialized():
            self._finish_pending()
        deferred_conv.uninstall_split(self._fused_layers)
        self._fused_layers = []
        if self._gradients is not None:
            self._gradients.close()
        super().teardown()

    def _drain(self) -> None:
        if self._async is not None and self._async.in_flight:
            with self.precision_plugin.train_step_context(), self._accumulation():
                self._async.drain()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Outputs of the batch's micro-batches, merged, on global rank 0 (None on other ranks)."""
        outputs = self._evaluate("predict_step", self.precision_plugin.predict_step_context, args, kwargs)
        if self.num_stages == 1:
            return outputs if self.global_rank == 0 else None
        box = [outputs]
        self._finish_pending()
        last = self.pipeline_ranks[self._last_position]
        if self.replica == 0 and last != self.pipeline_ranks[0]:  # replica 0's outputs go to rank 0
            if self.is_last_stage:
                dist.send_object_list(box, dst=self.pipeline_ranks[0], group=self._meta_group)
            elif self.global_rank == 0:
                dist.recv_object_list(box, src=last, group=self._meta_group)
        return box[0] if self.global_rank == 0 else None

    def _evaluate(self, hook: str, context: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
        """Forward-only pipeline of one evaluation batch; the hook runs on the last stage once per
        micro-batch. Returns the merged outputs on the last stage, None elsewhere."""
        if self._signals is not None:
            self._signals.stop_if_requested()
        # a replica without samples left joins the others' summary with none; sharded stages still run
        # the forward (its parameter all-gathers are collectives over the replicas), counting nothing
        padding = self._padding_step(hook, args)
        if padding and self._sharded is None:
            replay(self.lightning_module, self._share(hook, None, samples=0), self.root_device)
            return None
        module, micro, keys, weights, recorder = self._begin_step(hook, args)
        rest, keep = args[1:], self.is_last_stage and not padding
        outputs: list[Any] = [None] * len(micro)

        def step(i: int) -> None:
            with recorder.capture(module, weights[i], keep):
                output = getattr(module, hook)(micro[i], *rest, **kwargs)
            outputs[i] = output
            return None

        self._set_step(step)
        try:
            with context():
                self._executor.run(self._schedule("forward", len(micro)), keys)
            if self._sharded is not None:
                self._sharded.reshard()
            self._executor.transport.pass_gate()
        finally:
            self._set_step(None)
        samples = 0 if padding else sum(batch_size(mb) for mb in micro)
        summary = self._share(hook, None if padding else recorder, samples)
        replay(module, summary, self.root_device)
        recorder.log_local(module)
        return merge(outputs) if keep else None

    def _padding_step(self, hook: str, args: tuple) -> bool:
        """Whether this evaluation step only keeps this replica in step with replicas that have more
        samples (see :class:`lightning_pipe.runtime.replica_data.EvaluationShare`)."""
        if self.num_replicas == 1 or hook == "predict_step" or self.lightning_module is None:
            return False
        batch_idx = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
        dataloader_idx = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        return is_padding(self.lightning_module.trainer, batch_idx, dataloader_idx)

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Hand the gradients computed in ``training_step`` to the parameters (Lightning may have
        zeroed ``.grad`` in between); scaled like Lightning scales the loss under accumulation."""
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        assert self._gradients is not None
        self._gradients.hand_over(1.0 / module.trainer.accumulate_grad_batches)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        if self._async is not None:
            self._async.versions.protect()  # the optimizer changes the parameters in place next
        return closure_loss

    def _summary(self, recorder: Optional[StepRecorder], samples: Optional[int] = None) -> dict[str, Any]:
        """The last stage's step summary (None: a padding step's, empty); with replicas, combined
        over them (the global batch's): in evaluation weighted by each replica's ``samples``."""
        summary = recorder.summary() if recorder is not None else EMPTY
        if self.num_replicas > 1:
            assert self._topology is not None
            summary = combine_over_replicas(summary, self._topology.dp_group, self.root_device, samples)
        return summary

    def _share(self, kind: str, recorder: Optional[StepRecorder], samples: Optional[int] = None) -> dict[str, Any]:
        """The last stage's loss and logged means, on every rank (see :class:`SummarySharing`)."""
        summary = self._summary(recorder, samples) if self.is_last_stage else None
        if self.num_stages == 1:
            assert summary is not None
            return summary
        return self._summaries().share(kind, summary)

    def _summaries(self) -> SummarySharing:
        if self._sharing is None:
            self._sharing = SummarySharing(self.pipeline_ranks[self._last_position], self._meta_group, self.is_last_stage)
        return self._sharing

    def _finish_pending(self) -> None:
        if self._sharing is not None:
            self._sharing.finish_pending()

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Restore into the split module: each rank loads only the names its stage holds.
        return True

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        aliases = tie_aliases(self._ties, self.stage, f"{self.module_name}.")  # tied copies, for consolidation
        return optimizer_state_by_name(optimizer, parameter_names(module), aliases)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write a checkpoint directory: every rank its stage's shard, rank 0 the shared metadata,
        published only once every rank wrote its part (see :mod:`lightning_pipe.checkpoint.stage_io`)."""
        if storage_options is not None:
            raise TypeError("PipelineStrategy.save_checkpoint does not take storage_options.")
        self._finish_pending()
        self._drain()
        writer = stage_io.Writer(
            self.stage, self.num_stages, self.replica, self.is_global_zero, self.broadcast, self.barrier,
            self._topology.dp_group if self.sharded and self._topology is not None else None,
        )  # fmt: skip
        extra = {"async": self._async.state_dict()} if self._async is not None else None
        stage_io.save(checkpoint, Path(filepath), writer, extra)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """This rank's view of a checkpoint: the parameters of its stage, by name, from a pipeline
        checkpoint written under any number of stages (or a plain Lightning checkpoint)."""
        module = self.lightning_module
        assert module is not None
        checkpoint, async_state = stage_io.load(checkpoint_path, list(module.state_dict()), weights_only, super().load_checkpoint)
        self._restore_async(async_state)
        return checkpoint

    def _restore_async(self, state: Optional[dict[str, Any]]) -> None:
        """Give this stage its share of an asynchronous schedule's saved state."""
        if self._async is None or state is None:
            return
        assert self._stage_module is not None
        local = {name for name, _ in self._stage_module.named_parameters()}
        pending = {b: {n: g for n, g in grads.items() if n in local} for b, grads in state["pending"].items()}
        self._async.load_state_dict({"step": state["step"], "pending": pending})

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        module = self.lightning_module
        assert module is not None
        names = parameter_names(module)
        params = dict(module.named_parameters())
        for optimizer, named in zip(self.optimizers, checkpoint["optimizer_states"]):
            if self.sharded:  # each state tensor shaped like its parameter becomes this replica's shard
                named = {
                    **named,
                    "state": {
                        name: {k: _shard_state(v, params[name]) for k, v in state.items()} if name in params else state
                        for name, state in named["state"].items()
                    },
                }
            order = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
            optimizer.load_state_dict(optimizer_state_by_position(named, order))
            _optimizer_to_device(optimizer, self.root_device)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """As Lightning's, with whole tensors split into this replica's shards under ``shard``."""
        module = self.lightning_module
        assert module is not None
        state_dict = checkpoint["state_dict"]
        if self.sharded:
            current = module.state_dict()
            state_dict = {k: shard_like(v, current[k]) if k in current else v for k, v in state_dict.items()}
        module.load_state_dict(state_dict, strict=strict)

    # ------------------------------------------------------------------ gradient clipping
    def _patch_gradient_clipping(self) -> None:
        """Make ``gradient_clip_val`` (norm) clip by the norm over all stages' gradients."""
        plugin = self.precision_plugin
        if getattr(plugin, "_lightning_pipe_clip", False):
            return
        strategy = self

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: Union[int, float]) -> None:
            strategy.clip_grad_norm_(list(plugin.main_params(optimizer)), clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
        plugin._lightning_pipe_clip = True  # type: ignore[attr-defined]

    def clip_grad_norm_(self, parameters: Sequence[nn.Parameter], max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` with the 2-norm taken over every stage's gradients
        (see :meth:`lightning_pipe.gradients.StageGradients.clip_grad_norm_`)."""
        assert self._gradients is not None
        return self._gradients.clip_grad_norm_(parameters, max_norm, self.root_device)

    # ------------------------------------------------------------------ registration
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``"pipeline"`` for scripts, ``"pipeline_notebook"`` (fork) and ``"pipeline_spawn"``, as
        Lightning names its DDP variants. Registering again is a no-op."""
        for name, start_method in (("pipeline", "popen"), ("pipeline_notebook", "fork"), ("pipeline_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"Pipeline model parallelism (lightning-pipe), start_method={start_method!r}",
                    start_method=start_method,
                )


def _shard_state(value: Any, param: Tensor) -> Any:
    """An optimizer state value, split like ``param`` when it has ``param``'s whole shape."""
    if isinstance(value, Tensor) and value.dim() > 0 and is_dtensor(param) and tuple(value.shape) == tuple(param.shape):
        return shard_like(value, param)
    return value


__all__ = ["PipelineStrategy", "check_arguments"]
