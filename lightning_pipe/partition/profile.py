"""Measure every layer of the Sequential on the device, for ``balance="time"`` and ``"memory"``.

The input is real: one batch from the run's own DataLoader, split as the pipeline splits it, and
the first micro-batch run through the user's ``training_step`` up to the Sequential, so the layers
see exactly what they will see in training. Each layer is then moved to the device alone, timed
(forward and backward, a warm-up then several repetitions, the median kept) and metered (bytes
saved for the backward, through saved-tensor hooks), and moved back; its output feeds the next
layer. So only one layer and one micro-batch's activation are on the device at a time.

Profiling leaves no trace on the run: random states (the sampler's draw, dropout) and buffers
(batch-norm statistics) are restored and no gradient is kept. Nothing here is distributed; the
strategy profiles on one rank and broadcasts the result, so every rank splits alike.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import Tensor, nn

from lightning_pipe.partition.costs import LayerCost, Profile
from lightning_pipe.partition.materialize import allocate, check_initializable, has_meta_tensors, reset
from lightning_pipe.runtime.memory import SavedActivationMeter
from lightning_pipe.runtime.microbatch import as_tuple, from_tuple, split


class _Captured(BaseException):
    """Stops the user's step at the Sequential, whose input it carries."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


def first_batch(trainer: Any) -> Any:
    """One batch of the data the Trainer is about to run (training data when fitting), drawn from a
    fresh iterator of the user's DataLoader before Lightning sets it up. The caller restores the
    random state the draw consumes."""
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    loops = {
        TrainerFn.FITTING: trainer.fit_loop,
        TrainerFn.VALIDATING: trainer.validate_loop,
        TrainerFn.TESTING: trainer.test_loop,
        TrainerFn.PREDICTING: trainer.predict_loop,
    }
    source = loops[trainer.state.fn]._data_source
    loaders = source.dataloader()
    if isinstance(loaders, (Mapping, list, tuple)):
        loaders = CombinedLoader(loaders, "max_size_cycle" if trainer.state.fn == TrainerFn.FITTING else "sequential")
        iterator = iter(loaders)
        batch = next(iterator)[0]
    else:
        iterator = iter(loaders)
        batch = next(iterator)
    del iterator
    return batch


def sequential_input(module: nn.Module, layers: nn.Sequential, microbatch: Any) -> Any:
    """What the user's ``training_step`` passes to the Sequential for ``microbatch`` (the step is
    stopped there, before it computes or logs anything else). Run with gradients on, as in
    training, so that the value requires a gradient exactly where the pipeline's first stage
    must compute one (after trainable layers outside the Sequential)."""

    def capture(_: nn.Module, args: tuple) -> None:
        raise _Captured(args[0])

    handle = layers.register_forward_pre_hook(capture)
    try:
        with torch.enable_grad():
            module.training_step(microbatch, 0)
    except _Captured as captured:
        return captured.value
    except Exception as error:
        raise RuntimeError(
            "balance='time'/'memory' runs training_step on one micro-batch to find what it passes to the "
            f"Sequential, and the step failed before reaching it: {type(error).__name__}: {error}. Call the "
            "Sequential (self(...)) before anything that needs the running Trainer loop (such as self.log), or "
            "give balance as 'uniform', 'parameters' or a list of layer counts."
        ) from error
    finally:
        handle.remove()
    raise RuntimeError(
        "balance='time'/'memory': training_step never called the pipelined Sequential, so there is nothing "
        "to profile. The step must compute its output with self(...) (or the Sequential itself)."
    )


def user_optimizers(module: nn.Module) -> dict[int, tuple[type, dict[str, Any]]]:
    """The optimizer class and settings of each parameter (by ``id``), from the module's own
    ``configure_optimizers``. Empty when it cannot be called yet (optimizer state and update time
    are then not counted)."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    try:
        optimizers = _configure_optimizers(module.configure_optimizers())[0]
    except Exception:
        return {}
    found: dict[int, tuple[type, dict[str, Any]]] = {}
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        for group in optimizer.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            for param in group["params"]:
                found[id(param)] = (type(optimizer), settings)
    return found


def _update_cost(params: list[nn.Parameter], optimizers: dict[int, tuple[type, dict[str, Any]]], device: torch.device, repeats: int) -> tuple[int, float]:
    """Optimizer-state bytes and the median seconds of one optimizer step for ``params``, measured
    on copies of them (with zero gradients) under their own optimizer kind and settings."""
    state_bytes, seconds = 0, 0.0
    for param in params:
        if id(param) not in optimizers or not param.requires_grad:
            continue
        cls, settings = optimizers[id(param)]
        copy = param.detach().to(device).clone().requires_grad_(True)
        copy.grad = torch.zeros_like(copy)
        try:
            trial = cls([copy], **settings)
            times = []
            for rep in range(1 + repeats):
                _synchronize(device)
                start = time.perf_counter()
                trial.step()
                _synchronize(device)
                times.append(time.perf_counter() - start)
        except Exception:
            continue
        seconds += statistics.median(times[1:])
        state_bytes += sum(
            t.numel() * t.element_size() for s in trial.state.values() for t in s.values() if isinstance(t, Tensor) and t.dim() > 0
        )
    return state_bytes, seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes(tensors: tuple[Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_layers(
    layers: nn.Sequential,
    value: Any,
    device: torch.device,
    warmup: int = 1,
    repeats: int = 3,
    context: Callable[[], ContextManager[Any]] = nullcontext,
    optimizers: Optional[dict[int, tuple[type, dict[str, Any]]]] = None,
) -> list[LayerCost]:
    """Forward and backward seconds (median of ``repeats`` after ``warmup``) and bytes of each layer
    for the micro-batch activation ``value`` entering the first layer; with ``optimizers`` (see
    :func:`user_optimizers`) also its optimizer state and update time. A layer's input requires a
    gradient where it would in the pipeline: where ``value`` does, or after a layer with trainable
    parameters (the first layer on data computes no input gradient)."""
    optimizers = optimizers or {}
    costs: list[LayerCost] = []
    flags = tuple(bool(t.requires_grad) for t in as_tuple(value)[0])
    for original in layers:
        layer, layer_optimizers = _on_device(original, device, optimizers)
        tensors, was_tuple = as_tuple(value)
        tensors = tuple(t.detach().to(device) for t in tensors)
        forwards: list[float] = []
        backwards: list[float] = []
        saved = 0
        output: tuple[Tensor, ...] = ()
        params = list(layer.parameters())
        for rep in range(warmup + repeats):
            # a fresh non-leaf copy: layers may work in place on their input (ReLU(inplace=True))
            inputs = _inputs(tensors, flags)
            meter = SavedActivationMeter(params)
            _synchronize(device)
            start = time.perf_counter()
            with context(), meter.hooks():
                out = layer(from_tuple(inputs, was_tuple))
            _synchronize(device)
            middle = time.perf_counter()
            output, _ = as_tuple(out)
            saved = meter.current
            needing = [t for t in output if t.requires_grad]
            if needing:
                torch.autograd.backward(needing, [torch.ones_like(t) for t in needing])
            _synchronize(device)
            end = time.perf_counter()
            if rep >= warmup:
                forwards.append(middle - start)
                backwards.append(end - middle)
        input_backward, weight_backward = _split_backward(layer, tensors, flags, was_tuple, device, warmup, repeats, context)
        for p in params:
            p.grad = None
        parameter_bytes = sum(p.numel() * p.element_size() for p in params)
        state_bytes, update = _update_cost(params, layer_optimizers, device, repeats)
        costs.append(
            LayerCost(
                forward=statistics.median(forwards),
                backward=statistics.median(backwards),
                parameter_bytes=parameter_bytes,
                gradient_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
                optimizer_bytes=state_bytes,
                activation_bytes=saved,
                input_bytes=_bytes(tensors),
                output_bytes=_bytes(output),
                update=update,
                input_backward=input_backward,
                weight_backward=weight_backward,
            )
        )
        for p in params:
            p.grad = None
        flags = tuple(bool(t.requires_grad) for t in output)
        value = from_tuple(tuple(t.detach() for t in output), isinstance(out, (tuple, list)))
        if layer is original:
            layer.to(home_of(original))
    return costs


def home_of(layer: nn.Module) -> torch.device:
    """Where ``layer``'s tensors live (the CPU for a layer without any)."""
    return next(iter(layer.state_dict().values()), torch.empty(0)).device


def _on_device(
    layer: nn.Module, device: torch.device, optimizers: dict[int, tuple[type, dict[str, Any]]]
) -> tuple[nn.Module, dict[int, tuple[type, dict[str, Any]]]]:
    """``layer`` on ``device`` for measuring, and the optimizer settings of its parameters. A layer
    built on the meta device is measured as a temporary copy given storage and initialised as
    its modules define it, as the pipeline will (a module that cannot be is refused as the
    pipeline refuses it)."""
    if not has_meta_tensors(layer):
        layer.to(device)
        return layer, optimizers
    check_initializable(layer)
    real = copy.deepcopy(layer)
    allocate(list(real.modules()), device)
    reset(real)
    settings = {id(r): optimizers[id(o)] for r, o in zip(real.parameters(), layer.parameters()) if id(o) in optimizers}
    return real, settings


def _inputs(tensors: tuple[Tensor, ...], flags: tuple[bool, ...]) -> tuple[Tensor, ...]:
    """Fresh copies of ``tensors``, requiring a gradient where ``flags`` say (floating point only)."""
    return tuple(t.detach().requires_grad_(flag and t.is_floating_point()).clone() for t, flag in zip(tensors, flags))


def _split_backward(
    layer: nn.Module,
    tensors: tuple[Tensor, ...],
    flags: tuple[bool, ...],
    was_tuple: bool,
    device: torch.device,
    warmup: int,
    repeats: int,
    context: Callable[[], ContextManager[Any]],
) -> tuple[float, float]:
    """Median seconds of B and W of ``layer``'s backward split as the zero-bubble schedules split
    it: its plain ``Linear``/``ConvNd`` layers given the runtime's deferring forward, B the backward
    inside :func:`weight_store.deferring`, W running the work it deferred (0 where nothing was)."""
    from lightning_pipe.runtime import deferred_conv, fused_linear, weight_store

    installed = deferred_conv.install_split(layer)
    inputs_b: list[float] = []
    weights: list[float] = []
    try:
        for rep in range(warmup + repeats):
            inputs = _inputs(tensors, flags)
            with fused_linear.accumulating():
                with context():
                    out = layer(from_tuple(inputs, was_tuple))
                needing = [t for t in as_tuple(out)[0] if t.requires_grad]
                _synchronize(device)
                start = time.perf_counter()
                with weight_store.deferring() as works:
                    if needing:
                        torch.autograd.backward(needing, [torch.ones_like(t) for t in needing])
                _synchronize(device)
                middle = time.perf_counter()
                weight_store.run(works)
                _synchronize(device)
                end = time.perf_counter()
            if rep >= warmup:
                inputs_b.append(middle - start)
                weights.append(end - middle if works else 0.0)
    finally:
        deferred_conv.uninstall_split(installed)
    return statistics.median(inputs_b), statistics.median(weights)


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.to("meta")
    if isinstance(value, Mapping):
        return type(value)({k: _to_meta(v) for k, v in value.items()})  # type: ignore[call-arg]
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _random_like(value: Any, device: torch.device) -> Any:
    """Tensors of ``value``'s shapes and dtypes with storage on ``device``: normal floats (requiring
    a gradient where ``value``'s do), zero integers (valid indices), true booleans (masks that keep
    everything)."""
    tensors, was_tuple = as_tuple(value)
    real = []
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            real.append(torch.randn(t.shape, dtype=t.dtype, device=device).requires_grad_(t.requires_grad))
        elif t.dtype == torch.bool:
            real.append(torch.ones(t.shape, dtype=t.dtype, device=device))
        else:
            real.append(torch.zeros(t.shape, dtype=t.dtype, device=device))
    return from_tuple(tuple(real), was_tuple)


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []


def profile_module(
    module: nn.Module,
    layers: nn.Sequential,
    batch: Callable[[], Any],
    num_microbatches: int,
    device: torch.device,
    context: Callable[[], ContextManager[Any]] = nullcontext,
    memory: bool = True,
    warmup: int = 1,
    repeats: int = 3,
) -> Profile:
    """The profile of ``layers`` (the Sequential of ``module``) on ``device`` for the first
    micro-batch of the batch ``batch()`` gives. Random states (including those the batch's draw
    consumes) and buffers are as before when it returns."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    with torch.random.fork_rng(devices=_rng_devices(device)):
        micro = split(batch(), num_microbatches)[0]
        if has_meta_tensors(module):
            # built on the meta device (configure_model): the step runs there up to the Sequential,
            # which gives the shapes, and the layers, each given storage in turn, see random values
            value = _random_like(sequential_input(module, layers, _to_meta(micro)), device)
        else:
            value = sequential_input(module, layers, micro)
        optimizers = user_optimizers(module) if memory else {}
        costs = measure_layers(layers, value, device, warmup, repeats, context, optimizers)
    with torch.no_grad():
        for name, b in module.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
    size = as_tuple(value)[0][0].shape[0] if as_tuple(value)[0][0].dim() > 0 else 1
    return Profile(tuple(costs), size, str(device), repeats)




def agreed_profile(
    is_source: bool, broadcast: Callable[[Any], Any], measure: Callable[[], Profile], everywhere: bool = True
) -> Profile:
    """Measure and give every rank the source rank's (``is_source``) profile through
    ``broadcast``, so every rank computes the same split. With ``everywhere`` every rank measures
    at the same time and only the source's result is used: the measurement then sees what the
    ranks share while they train together (a host's cores, caches and memory bandwidth, a PCIe
    switch), as the pipeline will. A failure while measuring on the source is raised on every rank
    (with the source's message) instead of leaving the others waiting; another rank's failure is
    not its concern (its profile is not used)."""
    answer: tuple[Optional[Profile], Optional[str]] = (None, None)
    failure: Optional[BaseException] = None
    if is_source:
        try:
            answer = (measure(), None)
        except Exception as error:  # told to every rank below, then raised here
            failure = error
            answer = (None, f"{type(error).__name__}: {error}")
    elif everywhere:
        try:
            measure()
        except Exception:
            pass  # only the source's profile counts; training will meet this rank's problem itself
    profile, message = broadcast(answer)
    if failure is not None:
        raise failure
    if message is not None:
        raise RuntimeError(f"Profiling the layers on global rank 0 failed: {message}")
    assert profile is not None
    return profile


__all__ = ["agreed_profile", "first_batch", "measure_layers", "user_optimizers", "profile_module", "sequential_input"]
