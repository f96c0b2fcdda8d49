"""Every private name of Lightning, Hydra and torch the Trainer's side reaches, one function each.

``trainer/``, ``observe/``, the strategy and the CLI call these instead of touching another
package's ``_name``; ``tests/test_imports.py`` refuses such a name anywhere else but here and in
:mod:`lightning_pipe.torch_internals` (the core's). A leaf: it imports Lightning and torch, nothing
of this package (Hydra's one internal is Lightning's call of it). Each function says what it touches, why no public API
serves, and the versions it was checked with (Lightning 2.6, torch 2.13, Hydra 1.3); a new release
that moves one of these fails here, in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from lightning.pytorch.strategies.launchers import subprocess_script
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

# ---------------------------------------------------------------------------------------- the loops


def data_source(loop: Any) -> Any | None:
    """The loop's ``_DataConnector`` source (``loop._data_source``: ``dataloader()`` gives the
    user's loaders, ``instance`` the module or datamodule giving them); None when the loop has none.
    The Trainer's public ``train_dataloader`` and the like exist only once the loop set them up,
    and the pipeline needs a batch before that. Checked with Lightning 2.6."""
    return getattr(loop, "_data_source", None)


def evaluation_loaders(trainer: Any) -> list[Any]:
    """The loaders of the evaluation running now (``trainer._evaluation_loop._combined_loader.flattened``).
    The public ``trainer.val_dataloaders`` gives ``fit``'s validation loaders even in a later
    ``validate``. Checked with Lightning 2.6."""
    return trainer._evaluation_loop._combined_loader.flattened


def batches_that_stepped(trainer: Any) -> int:
    """The step loggers see (``fit_loop.epoch_loop._batches_that_stepped``), which differs from
    ``trainer.global_step`` with several optimizers or ``accumulate_grad_batches``; the latter where
    the loop has none. Lightning's logger connector reads the same attribute; nothing public gives
    it. Checked with Lightning 2.6."""
    return int(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step))


def pending_loader_states(trainer: Any) -> list[Any]:
    """The training loaders' states a checkpoint handed to the fit loop, not yet given to the loaders
    (``fit_loop._combined_loader_states_to_load``): whether a resumed checkpoint holds a data position,
    known when the loaders are built, before Lightning gives it to them. Checked with Lightning 2.6."""
    return list(getattr(trainer.fit_loop, "_combined_loader_states_to_load", None) or [])


def load_training_loader_states(trainer: Any) -> None:
    """Give the built training loaders the states a restored checkpoint handed to the fit loop
    (``fit_loop._load_combined_loader_states``, which Lightning calls only while it builds them), and
    make the data fetcher's iterator again (``iter(fit_loop._data_fetcher)``; the one made with the
    loaders read from the epoch's start). Lightning has no public way to hand a state to loaders it
    built before the restore. Checked with Lightning 2.6."""
    fit_loop = trainer.fit_loop
    fit_loop._load_combined_loader_states()
    if fit_loop._data_fetcher is not None:
        iter(fit_loop._data_fetcher)


def training_loaders_built(trainer: Any) -> bool:
    """Whether the fit loop holds its training loaders already (``fit_loop._combined_loader``); the
    public ``trainer.train_dataloader`` says the same but unwraps them. Checked with Lightning 2.6."""
    return getattr(trainer.fit_loop, "_combined_loader", None) is not None


def configure_optimizers(returned: Any) -> list[Any]:
    """The optimizers in what ``configure_optimizers`` returned, read as the Trainer reads any of its
    forms (``lightning.pytorch.core.optimizer._configure_optimizers``); the Trainer offers no public
    parser. Checked with Lightning 2.6."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    return _configure_optimizers(returned)[0]


def update_dataloader(dataloader: Any, sampler: Any, mode: Any = None) -> Any:
    """``dataloader`` rebuilt with ``sampler``, keeping the user's other arguments, as Lightning
    re-instantiates loaders for distributed samplers (``lightning.pytorch.utilities.data._update_dataloader``).
    Checked with Lightning 2.6."""
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler, mode=mode)


@contextmanager
def routed_log(module: Any, log: Callable[..., None]) -> Iterator[None]:
    """While open, ``module.log(...)`` calls ``log`` instead (an instance attribute over
    ``LightningModule.log``, deleted after): a micro-batch's step must not reach Lightning's logging,
    and Lightning has no hook to route ``self.log``. Checked with Lightning 2.6."""
    module.log = log
    try:
        yield
    finally:
        del module.log


@contextmanager
def sent_state_dict(module: Any, state_dict: Callable[..., Any]) -> Iterator[None]:
    """While open, ``module.state_dict()`` gives ``state_dict()`` (an instance attribute over
    ``nn.Module.state_dict``, deleted after): Lightning's spawn launcher sends the parent process
    what the module's ``state_dict`` gives (``_MultiProcessingLauncher._collect_rank_zero_results``),
    and for a pipeline that must be the whole model. Checked with Lightning 2.6 and torch 2.13."""
    module.state_dict = state_dict
    try:
        yield
    finally:
        del module.state_dict


def metric_sync_off(metric: Any) -> None:
    """Stop a torchmetrics ``Metric`` logged with ``self.log`` from syncing over processes when it
    computes: ``sync_on_compute = False`` and its ``_to_sync``, which Lightning's logging sets from
    ``sync_on_compute`` only when it creates the result and reads at compute; no public setter.
    Checked with Lightning 2.6 and torchmetrics 1."""
    metric.sync_on_compute = False
    metric._to_sync = False


# --------------------------------------------------------------------------------- the optimizers


def optimizer_to_device(optimizer: Optimizer, device: torch.device) -> None:
    """Move ``optimizer``'s state to ``device`` as Lightning's strategies do
    (``lightning.fabric.utilities.optimizer._optimizer_to_device``: every tensor but ``step``).
    Checked with Lightning 2.6."""
    from lightning.fabric.utilities.optimizer import _optimizer_to_device

    _optimizer_to_device(optimizer, device)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """:func:`optimizer_to_device` for each of ``optimizers`` (``_optimizers_to_device``), as
    ``Strategy.setup`` does. Checked with Lightning 2.6."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def scaler_found_infs(scaler: torch.amp.GradScaler, optimizer: Optimizer) -> dict[Any, torch.Tensor]:
    """The inf/NaN flags ``scaler.unscale_(optimizer)`` found, per device, which ``scaler.step``
    reads (``GradScaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]``, mutable):
    the stages agree on one verdict by writing it there. GradScaler has no public hook between
    ``unscale_`` and ``step``. Checked with torch 2.13."""
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


def scaler_device(scaler: torch.amp.GradScaler) -> torch.device:
    """The device of the scaler's scale tensor (``GradScaler._scale``), where its flags live when it
    found none; ``get_scale()`` gives a number only. Checked with torch 2.13."""
    return scaler._scale.device  # type: ignore[union-attr]


def replace_unscale(scaler: torch.amp.GradScaler, unscale: Callable[[Optimizer], None]) -> None:
    """Make ``scaler.unscale_`` call ``unscale`` (an instance attribute over ``GradScaler.unscale_``;
    ``unscale`` calls the original it took before): the stages agree on the inf/NaN verdict between
    ``unscale_`` and ``step``, and neither GradScaler nor Lightning's ``MixedPrecision`` has a hook
    there. Checked with torch 2.13 and Lightning 2.6."""
    scaler.unscale_ = unscale  # type: ignore[method-assign, assignment]


_EXTENDED: dict[tuple[type, type], type] = {}


def extend_class(instance: Any, mixin: type) -> None:
    """Make ``instance`` (of class ``C``) an instance of a subclass of ``(mixin, C)``, made once per
    class (``instance.__class__ = ...``): the Trainer chose the precision plugin's class from
    ``precision=``, so an override of its hooks must come as a subclass of whichever class that is;
    isinstance checks still hold. Nothing when it already is one. Checked with Lightning 2.6."""
    cls = type(instance)
    if issubclass(cls, mixin):
        return
    key = (mixin, cls)
    if key not in _EXTENDED:
        _EXTENDED[key] = type(
            f"{mixin.__name__.strip('_')}{cls.__name__}", (mixin, cls), {"__module__": mixin.__module__}
        )
    instance.__class__ = _EXTENDED[key]


# -------------------------------------------------------------------------- processes and signals


def default_process_group_backend(device: torch.device) -> str:
    """The backend Lightning's ``DDPStrategy`` picks for ``device``
    (``lightning.fabric.utilities.distributed._get_default_process_group_backend_for_device``).
    Checked with Lightning 2.6."""
    from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device

    return _get_default_process_group_backend_for_device(device)


def init_dist_connection(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """The default process group, set up as ``DDPStrategy.setup_environment`` does
    (``lightning.fabric.utilities.distributed._init_dist_connection``: the environment's address,
    port, rank and world size). Checked with Lightning 2.6."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    _init_dist_connection(cluster_environment, backend, **kwargs)


def sync_ddp_if_available(tensor: torch.Tensor, group: ProcessGroup | None, reduce_op: Any) -> torch.Tensor:
    """``DDPStrategy.reduce``'s reduction (``lightning.fabric.utilities.distributed._sync_ddp_if_available``:
    sum or mean over ``group``, the tensor itself without a process group). Checked with Lightning 2.6."""
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def default_store() -> Any:
    """The default process group's key-value store (``torch.distributed.distributed_c10d._get_default_store``),
    through which a failing rank tells the others why. torch keeps the store of ``init_process_group``
    to itself. Checked with torch 2.13."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


class _SigtermHook(_SignalConnector):
    def _sigterm_notifier_fn(self, signum: Any, frame: Any) -> None:
        self.on_sigterm(signum, frame)

    def on_sigterm(self, signum: Any, frame: Any) -> None:
        super()._sigterm_notifier_fn(signum, frame)


def signal_connector_class() -> type:
    """Lightning's ``_SignalConnector``, the class the Trainer's signal handling must be, whose SIGTERM
    handler (``_sigterm_notifier_fn``, registered by ``register_signal_handlers``) calls the public
    ``on_sigterm(signum, frame)`` that :class:`lightning_pipe.trainer.launch.signals.PipelineSignalConnector`
    overrides; the Trainer offers no way to change its SIGTERM handling. Checked with Lightning 2.6."""
    return _SigtermHook


def signal_connector(trainer: Any) -> Any:
    """``trainer._signal_connector``: the Trainer's signal handling. Checked with Lightning 2.6."""
    return trainer._signal_connector


def set_signal_connector(trainer: Any, connector: Any) -> None:
    """Replace ``trainer._signal_connector`` (before the Trainer registers its handlers, which it
    does after setting the strategy up). Checked with Lightning 2.6."""
    trainer._signal_connector = connector


# ----------------------------------------------------------------------------------- the launchers


def set_launcher(strategy: Any, launcher: Any) -> None:
    """``strategy._launcher = launcher``: the launcher the Trainer starts the processes with, which a
    strategy sets in its ``_configure_launcher`` (see :class:`LauncherHook`). Lightning's strategies
    set it there themselves; the attribute has no public setter. Checked with Lightning 2.6."""
    strategy._launcher = launcher


class LauncherHook:
    """A strategy's launcher, made by its public ``make_launcher()`` (mixed in before Lightning's
    ``Strategy``): the Trainer asks a strategy for its launcher through ``_configure_launcher``, once
    its cluster environment is set (``_AcceleratorConnector``). Checked with Lightning 2.6."""

    def make_launcher(self) -> Any:
        """The launcher the Trainer starts this strategy's processes with."""
        raise NotImplementedError

    def _configure_launcher(self) -> None:
        set_launcher(self, self.make_launcher())


def launcher_class() -> type:
    """Lightning's ``_Launcher``, the base of every strategy launcher
    (``lightning.pytorch.strategies.launchers.launcher``); a strategy's ``_launcher`` is one.
    Checked with Lightning 2.6."""
    return _Launcher


class _ExtendedMultiProcessingLauncher(_MultiProcessingLauncher):
    def __init__(
        self, strategy: Any, start_method: str, after_worker: Callable[[], None], collect: Callable[..., Any]
    ) -> None:
        super().__init__(strategy, start_method=start_method)  # type: ignore[arg-type]  # checked by the strategy
        self._after_worker = after_worker
        self._collect = collect

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        self._after_worker()

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        lightning = super()._collect_rank_zero_results
        return self._collect(trainer, lambda: lightning(trainer, results))


def multiprocessing_launcher(
    strategy: Any, start_method: str, after_worker: Callable[[], None], collect: Callable[[Any, Callable[[], Any]], Any]
) -> Any:
    """Lightning's ``_MultiProcessingLauncher`` (``spawn`` / ``fork``) with two of its private
    steps extended: its worker function (``_wrapping_function``) followed by ``after_worker()``, and
    its rank-zero results (``_collect_rank_zero_results``) made by ``collect(trainer, lightning)``,
    where ``lightning()`` gives Lightning's (a ``_WorkerOutput`` namedtuple, or None). Lightning
    has no public hook for either. Both callables travel to the workers: module-level functions or
    partials of them. Checked with Lightning 2.6."""
    return _ExtendedMultiProcessingLauncher(strategy, start_method, after_worker, collect)


class _HydraChildrenLauncher(subprocess_script._SubprocessScriptLauncher):
    def __init__(
        self,
        cluster_environment: Any,
        num_processes: int,
        num_nodes: int,
        child: Callable[[int], tuple[list[str], str]],
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._child = child

    def _call_children_scripts(self) -> None:
        with mock.patch.object(subprocess_script, "_hydra_subprocess_cmd", self._child):
            super()._call_children_scripts()


def script_launcher(
    cluster_environment: Any, num_processes: int, num_nodes: int, child_command: Callable[[int], tuple[list[str], str]]
) -> Any:
    """Lightning's ``_SubprocessScriptLauncher`` (``start_method="popen"``) whose extra processes
    under Hydra run ``child_command(local_rank)`` (command and working directory): its
    ``_call_children_scripts`` with ``subprocess_script._hydra_subprocess_cmd`` patched, the only
    place Lightning builds that command. Checked with Lightning 2.6 and Hydra 1.3."""
    return _HydraChildrenLauncher(cluster_environment, num_processes, num_nodes, child_command)


def recopy_averaged_models(trainer: Any, module: Any) -> None:
    """Lightning's ``StochasticWeightAveraging`` copies the module in its ``setup`` hook, before the
    strategy's setup splits it: its copy (``_average_model``) would hold the whole model while this rank
    holds one stage, and averaging would pair the tensors of different layers. Copied again from the
    split module. Checked with Lightning 2.6."""
    import copy

    from lightning.pytorch.callbacks import StochasticWeightAveraging

    for callback in trainer.callbacks:
        if isinstance(callback, StochasticWeightAveraging) and callback._average_model is not None:
            callback._average_model = copy.deepcopy(module)


# ------------------------------------------------------------------------------------------ Fabric


def without_backward_sync(strategy: Any) -> None:
    """A Fabric strategy without gradient-sync control (``strategy._backward_sync_control = None``), so
    that ``fabric.no_backward_sync`` warns that it does nothing instead of DDP's control refusing a module
    it did not wrap; Fabric reads the attribute, which has no public setter. Checked with Lightning 2.6."""
    strategy._backward_sync_control = None


@contextmanager
def in_fabric_backward() -> Iterator[None]:
    """While open, Fabric counts backward passes as its own (``lightning.fabric.wrappers._in_fabric_backward``):
    a set-up module's outputs carry a hook that refuses a backward not run by ``fabric.backward``, and the
    pipeline runs the backward of each micro-batch inside its step. Checked with Lightning 2.6."""
    from lightning.fabric import wrappers

    before = wrappers._in_fabric_backward
    wrappers._in_fabric_backward = True
    try:
        yield
    finally:
        wrappers._in_fabric_backward = before
