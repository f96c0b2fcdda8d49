"""``PipelineStrategy``: Lightning's hooks over one :class:`~lightning_pipe.runtime.pipeline.StagePipeline` per rank.

As ``DDPStrategy`` hands a step's work to the ``DistributedDataParallel`` wrapper, this strategy
hands it to the pipeline: ``setup`` splits the module (:mod:`lightning_pipe.trainer.stage_setup`) and builds
the pipeline; ``training_step`` runs the whole schedule of a batch through it
(:mod:`lightning_pipe.trainer.steps`), and ``backward`` hands the gradients it kept to the parameters
(Lightning zeroes ``.grad`` in between). Launching, optimizers, loops and callbacks are
Lightning's own; the processes are set up as in ``DDPStrategy`` (:mod:`lightning_pipe.trainer.launch.processes`).
"""

from __future__ import annotations

import inspect
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import Unpack

from lightning_pipe.arguments import PipelineArguments
from lightning_pipe.assembly.split import ModuleSplit
from lightning_pipe.config import register_variants, split_arguments, strategy_signature
from lightning_pipe.runtime.pipeline import StagePipeline
from lightning_pipe.runtime.timings import Timeline
from lightning_pipe.runtime.topology import Layout, Topology, describe_rank
from lightning_pipe.trainer import checkpoint_hooks as hooks
from lightning_pipe.trainer import internals, nothing_to_train, random_states, stopping
from lightning_pipe.trainer.compatibility import check_automatic_optimization, check_correction_optimizers
from lightning_pipe.trainer.dataloaders.loaders import stage_dataloader
from lightning_pipe.trainer.dataloaders.resume_data import give_saved_position
from lightning_pipe.trainer.launch import failures, restarts, signals
from lightning_pipe.trainer.launch.launcher import Gathering, launcher_for
from lightning_pipe.trainer.launch.processes import ProcessStrategy
from lightning_pipe.trainer.precision import across_stages
from lightning_pipe.trainer.preflight import check_before_launch
from lightning_pipe.trainer.stage_setup import build_pipeline, split_module
from lightning_pipe.trainer.steps import PipelineSteps

_PROCESS_ARGUMENTS = tuple(p for p in inspect.signature(ProcessStrategy.__init__).parameters if p != "self")


def _argument(name: str) -> property:  # one of the run's arguments (after plan="auto", the planner's choice)
    return property(lambda self: getattr(self.config, name), doc=f"``config.{name}`` (see :class:`PipelineConfig`).")


def _decided(name: str, doc: str) -> property:  # what splitting the module decided (None before the split)
    return property(lambda self: getattr(self._split, name) if self._split is not None else None, doc=doc)


class PipelineStrategy(internals.LauncherHook, ProcessStrategy):
    """Pipeline model parallelism: one stage of the module's ``nn.Sequential`` per process.

    The arguments are checked once and kept in ``strategy.config`` (:class:`~lightning_pipe.config.PipelineConfig`
    documents each); ``processes`` are ``DDPStrategy``'s
    (:class:`~lightning_pipe.trainer.launch.processes.ProcessStrategy`).
    Layers built in ``configure_model()`` are built on the meta device; each rank materialises only its stage.
    """

    strategy_name = "pipeline"

    def __init__(self, **arguments: Unpack[PipelineArguments]) -> None:
        """Every argument of :class:`PipelineConfig`, by its flat name, and ``ProcessStrategy``'s (the signature
        lists them: ``help(PipelineStrategy)``;
        :class:`~lightning_pipe.arguments.PipelineArguments` types them for editors and type checkers)."""
        self.config, processes = split_arguments(arguments, _PROCESS_ARGUMENTS)
        super().__init__(**processes)
        self._topology: Topology | None = None  # process groups, built once (creating a group is collective)
        self._split: ModuleSplit | None = None  # what splitting the module decided, kept for the run
        self._pipeline: StagePipeline | None = None
        self._steps: PipelineSteps | None = None
        self._signals: signals.PipelineSignalConnector | None = None
        self._failure: BaseException | None = None  # what failed the run, not to be hidden by teardown
        self._rng = random_states.ResumedRandom()  # the random state a resume hands back

    schedule_name = _argument("schedule")
    chunks = _argument("chunks")
    balance = _argument("balance")
    recompute = _argument("recompute")
    virtual_stages = _argument("virtual_stages")
    stages = _argument("stages")
    data_parallel = _argument("data_parallel")
    gradient_accumulation_fusion = _argument("gradient_accumulation_fusion")
    check_data = _argument("check_data")
    weights = _argument("weights")
    profile = _decided("profile", "The measured layer costs (``balance='time'/'memory'``, ``plan='auto'``).")
    plan_candidates = _decided("candidates", "``plan='auto'``: the ranked layouts; the first one runs.")
    stage_balance = _decided("balance", "Layers per stage.")
    rank_resources = _decided("resources", "Every rank's speed and free memory that weighted a measured balance.")
    deferred_build = _decided("deferred_build", "Whether the module was built on the meta device.")

    plan_all_layouts = property(  # `lightning-pipe plan` sets it before fitting: rank every stages x replicas too
        lambda self: self.config.plan_all_layouts,
        lambda self, on: setattr(self, "config", self.config.replace(plan_all_layouts=on)),
    )

    @property
    def pipeline(self) -> StagePipeline:
        """This rank's pipeline (its runners, gradients, transport), once the Trainer set the strategy up."""
        if self._pipeline is None:
            raise RuntimeError("The pipeline is not set up yet: use it once the Trainer set it up (on_fit_start).")
        return self._pipeline

    # ------------------------------------------------------------------ processes
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds on the meta device; ``setup`` materialises the stage."""
        with torch.device("meta") if empty_init else super().tensor_init_context(empty_init):
            yield

    def model_sharded_context(self) -> Any:
        """``configure_model()`` builds on the meta device; ``setup`` materialises the stage."""
        return torch.device("meta")

    def process_dataloader(self, dataloader: object) -> object:
        """Every stage draws the first stage's order, each replica its part (see ``stage_dataloader``)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return stage_dataloader(dataloader, trainer, self.layout, self.global_rank, self._topology, self._rng.at_data)

    def make_launcher(self) -> Any:
        assert self.cluster_environment is not None
        before = partial(check_before_launch, config=self.config, layout=self.layout)  # a bad world fails here
        go = restarts.resumer(self.config.elastic)  # elastic runs: fit from the newest checkpoint
        return launcher_for(self, self.config.start_method, self._gathering, before, go)

    def _gathering(self) -> Gathering:
        assert self._topology is not None, "every rank is set up before a worker's results are collected"
        return Gathering(self._topology.gather_group, self.layout.pipeline_ranks(0), not self.deferred_build)

    # ------------------------------------------------------------------ topology
    @property
    def layout(self) -> Layout:
        """Stages x replicas of the world (:func:`.elastic.layout`), placed as the split decided once it exists."""
        split = self._split
        return split.placement.layout if split else restarts.layout(self.num_nodes * self.num_processes, self.config)

    num_stages = property(lambda self: self.layout.stages, doc="Pipeline depth: processes per pipeline.")
    num_replicas = property(lambda self: self.layout.replicas, doc="Replicas of the pipeline.")
    stage = property(lambda self: self.layout.stage_of(self.global_rank), doc="This rank's pipeline position.")
    replica = property(lambda self: self.layout.replica_of(self.global_rank), doc="This rank's replica.")
    pipeline_ranks = property(lambda self: self.layout.pipeline_ranks(self.replica), doc="This pipeline's ranks.")
    sharded = property(lambda self: self.config.data_parallel == "shard" and self.num_replicas > 1, doc="FSDP2 stages.")

    def describe_rank(self, rank: int) -> str:
        """``rank r (stage s of p)``: how errors name a process."""
        return describe_rank(self.layout, rank)

    def enable_timeline(self, keep: int | None = None) -> Timeline:
        """Record each action's time from the next step on (see :meth:`StagePipeline.enable_timeline`)."""
        return self.pipeline.enable_timeline(keep)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None and self.model is not None
        self.accelerator.setup(trainer)
        self._signals = signals.install(trainer)
        module, fitting = self.lightning_module, trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_automatic_optimization(module)
            stopping.agree_on_stops(trainer)  # should_stop set on one rank stops every rank at the same step
        measure = (self.root_device, self.batch_to_device, self.broadcast, self.precision_plugin.train_step_context)
        self._split = split_module(module, self.config, self.layout, self.global_rank, measure, self._split)
        self.config = self._split.config
        internals.recopy_averaged_models(trainer, module)  # StochasticWeightAveraging copied the unsplit module
        if self._topology is None:  # this rank's process groups, built once, where the split placed the ranks
            self._topology = Topology(self._split.placement.layout, self.global_rank, self.root_device.type)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        scaler = getattr(self.precision_plugin, "scaler", None)
        if self._pipeline is not None:
            self._pipeline.close()
        self._pipeline = build_pipeline(module, self._split, self._topology, scaler)
        stop = self._signals.stop_if_requested
        self._steps = PipelineSteps(self._pipeline, self.config, self._topology, module, self.precision_plugin, stop)
        if fitting:  # a stage with nothing to train (a frozen backbone) runs its part with an empty optimizer
            nothing_to_train.setup_optimizers(partial(self.setup_optimizers, trainer), self.root_device)
        self.setup_precision_plugin()
        if fitting:
            internals.optimizers_to_device(self.optimizers, self.root_device)
            self._pipeline.attach_optimizers(self.optimizers)  # PipeMare's step size and velocity follow them
            correction, clip = self.config.delay_correction, trainer.gradient_clip_val
            if (said := check_correction_optimizers(correction, self.optimizers, clip)) is not None:
                rank_zero_warn(said)
        across_stages(self.precision_plugin, self.clip_grad_norm_)  # clipping by the global norm, one scaler verdict

    def teardown(self) -> None:
        if dist.is_available() and dist.is_initialized() and self._steps is not None:
            self._steps.finish_pending()
        if self._signals is not None:
            self._signals.finish()  # the last step's stop flag, still travelling
        if self._pipeline is not None:
            self._pipeline.close()
        failures.after_failure(self._failure, super().teardown)

    # ------------------------------------------------------------------ steps
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._rng.at_step()  # a resumed run's random state, where the saved run stood
        return self.steps.training_step(args, kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Hand the step's gradients to the parameters, scaled as Lightning scales the loss under accumulation."""
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.pipeline.hand_over_gradients(1.0 / module.trainer.accumulate_grad_batches)
        return self.precision_plugin.post_backward(closure_loss, module)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.evaluate("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.evaluate("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.predict_step(args, kwargs)

    @property
    def steps(self) -> PipelineSteps:
        assert self._steps is not None, "the strategy runs steps once the Trainer has set it up"
        return self._steps

    def on_train_start(self) -> None:
        """A training loader built before the checkpoint was restored gets its saved position here."""
        if self.lightning_module is not None:
            give_saved_position(self.lightning_module.trainer, self._rng.at_data)

    def on_validation_start(self) -> None:
        self.steps.finish_in_flight()

    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks why this one fails, or why they fail (:mod:`lightning_pipe.trainer.launch.failures`)."""
        self._failure = exception
        failures.note(exception, self.global_rank, self.describe_rank)

    def clip_grad_norm_(self, parameters: Sequence[nn.Parameter], max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` with the 2-norm taken over every stage's gradients."""
        return self.pipeline.clip_grad_norm_(parameters, max_norm)

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # restore into the split module: each rank loads only the names its stage holds

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        aliases = self._split.optimizer_aliases() if self._split else None
        return hooks.optimizer_state(self.lightning_module, optimizer, aliases)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self.steps.finish_in_flight()
        assert self._split is not None and self._topology is not None  # set up with the steps
        writer = self._split.writer(self._topology, self.is_global_zero, self.broadcast, self.barrier)
        hooks.save_checkpoint(checkpoint, filepath, storage_options, writer, self.pipeline.state_dict())

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint, async_state = hooks.load_checkpoint(
            self.lightning_module, checkpoint_path, weights_only, super().load_checkpoint
        )
        self.pipeline.load_state_dict(async_state)
        return self._rng.take(checkpoint, self._split.random_key() if self._split else None, self.global_rank)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        hooks.load_optimizer_state_dict(
            self.lightning_module, self.optimizers, checkpoint, self.sharded, self.root_device, self.optimizer_state
        )

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        hooks.load_model_state_dict(self.lightning_module, checkpoint, strict, self.sharded)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``"pipeline"``, ``"pipeline_notebook"`` (fork), ``"pipeline_spawn"`` (:data:`.config.VARIANTS`)."""
        register_variants(cls, strategy_registry)


PipelineStrategy.__signature__ = strategy_signature(ProcessStrategy.__init__)  # type: ignore[attr-defined]
PipelineStrategy.__init__.__signature__ = strategy_signature(ProcessStrategy.__init__, self=True)  # type: ignore[attr-defined]
