"""``FabricPipelineStrategy``: Lightning Fabric's processes over one pipeline per rank.

Its processes, launchers and collectives are Fabric's ``DDPStrategy``'s (``fabric.launch()``: the script
launcher re-runs the script, ``start_method="spawn"``/``"fork"`` start a function), without DDP's wrapper:
``fabric.setup`` splits the model with :func:`lightning_pipe.build_pipeline`, keeps this rank's stages and
narrows the optimizers to their parameters. A batch runs through the whole schedule in :meth:`train_step`
(the loss's backward included, scaled under ``precision="16-mixed"``), so ``fabric.backward`` has nothing
to do; clipping takes the norm over every stage (and the gradient scaler one verdict over them), and
``fabric.save``/``fabric.load`` write and read the stage files (:mod:`lightning_pipe.fabric.checkpoints`).
The DataLoaders that ``fabric.setup_dataloaders`` makes give every stage of a replica the same batches,
each replica its part.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.wrappers import is_wrapped
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe.assembly.build import build_pipeline, layout_of
from lightning_pipe.assembly.loop import LossFn, PlainPipeline
from lightning_pipe.assembly.refusals import check_elastic_scaler
from lightning_pipe.checkpoint import stage_io
from lightning_pipe.config import PipelineConfig, split_arguments
from lightning_pipe.fabric import checkpoints
from lightning_pipe.fabric.optimizers import keep_held_parameters, names_by_identity
from lightning_pipe.runtime.topology import Layout
from lightning_pipe.schedules import is_async
from lightning_pipe.trainer import internals
from lightning_pipe.trainer.precision import sync_gradient_scaler

#: Fabric's ``DDPStrategy`` arguments that this strategy takes (the rest are DDP's wrapper's)
PROCESS_ARGUMENTS = (
    "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision", "process_group_backend",
    "timeout",
)  # fmt: skip


class FabricPipelineStrategy(DDPStrategy):
    """Pipeline model parallelism under Lightning Fabric: ``Fabric(strategy=FabricPipelineStrategy(...))``
    or ``Fabric(strategy="pipeline")``.

    The arguments are :class:`~lightning_pipe.PipelineStrategy`'s (``schedule``, ``chunks``, ``balance``,
    ``module``, ``stages``, ...; ``start_method`` chooses Fabric's launcher) and Fabric's process arguments.
    """

    strategy_name = "pipeline"

    def __init__(self, **arguments: Any) -> None:
        config, processes = split_arguments(arguments, PROCESS_ARGUMENTS)
        super().__init__(start_method=config.start_method, **processes)
        self.config: PipelineConfig = config
        self._arguments = {k: v for k, v in arguments.items() if k not in PROCESS_ARGUMENTS}
        self._pipe: PlainPipeline | None = None
        self._names: dict[int, str] = {}  # the unsplit module's parameter names, by identity
        self._held_optimizers: list[Optimizer] = []
        internals.without_backward_sync(self)  # fabric.no_backward_sync warns: train_step hands the gradients over

    # ------------------------------------------------------------------ layout
    @property
    def layout(self) -> Layout:
        """Stages x replicas of the world, placed by ``rank_order`` where given."""
        return self._pipe.placement.layout if self._pipe is not None else layout_of(self.world_size, self.config)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One part of the data per replica: every stage of a replica reads the same batches."""
        layout = self.layout
        return {"num_replicas": layout.replicas, "rank": layout.replica_of(self.global_rank)}

    @property
    def pipe(self) -> PlainPipeline:
        """This rank's :class:`~lightning_pipe.assembly.loop.PlainPipeline`, once ``fabric.setup`` ran."""
        if self._pipe is None:
            raise RuntimeError("The pipeline is not set up yet: call model = fabric.setup(model, optimizer) first.")
        return self._pipe

    # ------------------------------------------------------------------ the model
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)`` builds on the meta device: each rank materialises only its
        stage in ``fabric.setup`` (initialised per layer, as ``PipelineStrategy(init=...)`` says)."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing for a module built on the meta device (its stages are materialised where they run)."""
        if not any(t.is_meta for t in module.state_dict(keep_vars=True).values()):
            module.to(self.root_device)

    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]  # no DDP wrapper
        """Split ``module`` in place: it keeps this rank's stages under their own names."""
        if self._pipe is not None:
            if module is self._pipe.module:
                return module
            raise RuntimeError(
                "FabricPipelineStrategy pipelines one model, and fabric.setup was called with a second one. Set up "
                "only the model to pipeline; use other models (a frozen teacher, an EMA copy) without fabric.setup."
            )
        scaler = self._scaler()
        if scaler is not None:  # precision="16-mixed"
            check_scaler(self.config, scaler)
        self._names = names_by_identity(module)
        self._pipe = build_pipeline(module, device=self.root_device, **self._arguments)
        if scaler is not None:
            sync_gradient_scaler(scaler)  # every stage skips the steps any stage's gradients overflowed in
            scaler.scale(torch.zeros((), device=self.root_device))  # its scale made here: not every stage scales a loss
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``optimizer``, narrowed to the parameters this rank keeps (made before the split, or after it)."""
        pipe = self.pipe
        keep_held_parameters(optimizer, pipe.module, self._names)
        internals.optimizer_to_device(optimizer, self.root_device)
        self._held_optimizers.append(optimizer)
        pipe.attach_optimizers(*self._held_optimizers)
        return optimizer

    # ------------------------------------------------------------------ steps
    def train_step(self, model: nn.Module, batch: Any, loss_fn: LossFn) -> Tensor:
        """Forward and backward of ``batch`` through the schedule: ``loss_fn(micro_batch)`` runs on every rank
        (``model(...)`` in it runs this rank's stages); the gradients are added to ``.grad`` as
        ``fabric.backward(loss)`` adds them. Returns the batch's loss, on every rank."""
        pipe, scaler = self._pipe_of(model), self._scaler()
        with internals.in_fabric_backward():
            if scaler is None:
                return pipe.train_step(batch, loss_fn)
            scaled = pipe.train_step(batch, lambda micro: scaler.scale(loss_fn(micro)))
            return scaled / scaler.get_scale()  # a power of two: the loss exactly

    def evaluate(self, model: nn.Module, batch: Any, loss_fn: LossFn) -> Tensor:
        """Forward only, without gradients: the batch's loss, on every rank."""
        return self._pipe_of(model).evaluate(batch, loss_fn)

    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "Under the pipeline strategy the backward runs inside the step: loss = fabric.strategy.train_step(model, "
            "batch, loss_fn) gives the gradients. Remove fabric.backward(loss)."
        )

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the 2-norm over every stage's gradients (every rank calls it); returns that norm."""
        if float(norm_type) != 2.0:
            raise ValueError(
                f"fabric.clip_gradients(norm_type={norm_type}): the pipeline clips by the 2-norm over every "
                "stage's gradients. Leave norm_type at 2."
            )
        self.precision.unscale_gradients(optimizer)
        parameters = list(self.precision.main_params(optimizer))
        norm = self.pipe.pipeline.clip_grad_norm_(parameters, float(max_norm))
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(
                f"The total norm of the gradients over every stage is {float(norm)}, so they cannot be clipped. "
                "Pass error_if_nonfinite=False to clip anyway."
            )
        return norm

    def _scaler(self) -> torch.amp.GradScaler | None:
        """The gradient scaler of ``precision="16-mixed"``, which scales each micro-batch's loss."""
        return getattr(self.precision, "scaler", None)

    def _pipe_of(self, model: nn.Module) -> PlainPipeline:
        pipe = self.pipe
        inner = model.module if is_wrapped(model) else model
        if inner is not pipe.module:
            raise ValueError("This strategy's train_step and evaluate take the model that fabric.setup returned.")
        return pipe

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """The checkpoint directory ``path``: every rank writes its stage's file, rank 0 the metadata."""
        checkpoints.save(self.pipe, path, state, filter)

    def load_checkpoint(
        self,
        path: str | Path,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` from a checkpoint directory written under any layout (each rank reads its stage)."""
        pipe = self.pipe
        if isinstance(state, nn.Module):
            checkpoints.load_module(pipe, path, strict, weights_only)
            return {}
        if isinstance(state, Optimizer):
            raise ValueError(
                "fabric.load_raw(path, optimizer) reads an optimizer state by the unsplit model's positions; use "
                "fabric.load(path, {'model': model, 'optimizer': optimizer}) on a checkpoint fabric.save wrote."
            )
        if not state:
            local = list(pipe.module.state_dict())
            read = lambda p, w: torch.load(p, weights_only=w)  # noqa: E731
            return stage_io.load(path, local, weights_only, read)[0]
        return checkpoints.load(pipe, path, state, strict, weights_only)

    def teardown(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``"pipeline"``, ``"pipeline_notebook"`` (fork), ``"pipeline_spawn"``."""
        from lightning_pipe.config import register_variants

        register_variants(cls, strategy_registry)


def check_scaler(config: PipelineConfig, scaler: torch.amp.GradScaler) -> None:
    """What a gradient scaler cannot run with: elastic averaging, and the schedules that apply gradients late."""
    check_elastic_scaler(config.replicas_sync, scaler)
    if is_async(config.schedule):
        raise ValueError(
            f"schedule={config.schedule!r} applies gradients a step late, when the loss scale of "
            "precision='16-mixed' may have changed. Use precision='bf16-mixed' or a synchronous schedule."
        )
