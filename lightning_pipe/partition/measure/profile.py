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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.partition.solvers.costs import LayerCost, Profile
from lightning_pipe.partition.stages.materialize import (
    Initializer,
    allocate,
    check_initializable,
    has_meta_tensors,
    reset,
)
from lightning_pipe.runtime.activations.meter import SavedActivationMeter
from lightning_pipe.runtime.blocks.container import LoopedContainer
from lightning_pipe.runtime.crossing.skips import declared, skip_scope
from lightning_pipe.runtime.microbatch import as_tuple, from_tuple, split


class _Captured(BaseException):
    """Stops the user's step at the Sequential, whose input it carries."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


def sequential_input(module: Any, layers: nn.Sequential | nn.ModuleList, microbatch: Any) -> Any:
    """What the user's ``training_step`` passes to the Sequential for ``microbatch`` (the step is
    stopped there, before it computes or logs anything else). Run with gradients on, as in
    training, so that the value requires a gradient exactly where the pipeline's first stage
    must compute one (after trainable layers outside the Sequential)."""

    def capture(_: nn.Module, args: tuple) -> None:
        raise _Captured(args[0])

    handles = [layers.register_forward_pre_hook(capture)]
    if isinstance(layers, nn.Sequential) and len(layers) > 0:  # a forward that loops over the layers
        handles.append(layers[0].register_forward_pre_hook(capture))
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
        for handle in handles:
            handle.remove()
    raise RuntimeError(
        "balance='time'/'memory': training_step never called the pipelined Sequential, so there is nothing "
        "to profile. The step must compute its output with self(...) (or the Sequential itself)."
    )


def user_optimizers(optimizers: Callable[[], Sequence[Any]]) -> dict[int, tuple[type, dict[str, Any]]]:
    """The optimizer class and settings of each parameter (by ``id``), from the optimizers
    ``optimizers()`` gives (the module's own ``configure_optimizers``, as the Trainer reads it).
    Empty when they cannot be made yet (optimizer state and update time are then not counted)."""
    try:
        made = list(optimizers())
    except Exception:
        return {}
    found: dict[int, tuple[type, dict[str, Any]]] = {}
    for optimizer in made:
        for group in optimizer.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            for param in group["params"]:
                found[id(param)] = (type(optimizer), settings)
    return found


def _update_cost(
    params: list[nn.Parameter], optimizers: dict[int, tuple[type, dict[str, Any]]], device: torch.device, repeats: int
) -> tuple[int, float]:
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
            for _rep in range(1 + repeats):
                _synchronize(device)
                start = time.perf_counter()
                trial.step()
                _synchronize(device)
                times.append(time.perf_counter() - start)
        except Exception:
            continue
        seconds += statistics.median(times[1:])
        state_bytes += sum(
            t.numel() * t.element_size()
            for s in trial.state.values()
            for t in s.values()
            if isinstance(t, Tensor) and t.dim() > 0
        )
    return state_bytes, seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes(tensors: tuple[Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Timing:
    """How each measurement runs: ``warmup`` runs, then the median of ``repeats``, each in ``context``
    (the precision's training-step context: autocast under mixed precision)."""

    warmup: int = 1
    repeats: int = 3
    context: Callable[[], AbstractContextManager[Any]] = nullcontext


def measure_layers(
    layers: nn.Sequential | nn.ModuleList,
    value: Any,
    device: torch.device,
    timing: Timing = Timing(),
    optimizers: dict[int, tuple[type, dict[str, Any]]] | None = None,
    calls: Sequence[BlockCall] | None = None,
    initializer: Initializer | None = None,
) -> list[LayerCost]:
    """Forward and backward seconds (as ``timing`` says) and bytes of each layer
    for the micro-batch activation ``value`` entering the first layer; with ``optimizers`` (see
    :func:`user_optimizers`) also its optimizer state and update time. A layer's input requires a
    gradient where it would in the pipeline: where ``value`` does, or after a layer with trainable
    parameters (the first layer on data computes no input gradient). With ``calls`` (blocks of a
    block container) layer ``i`` is called on ``calls[i]``'s hidden state and other arguments, as
    the model's forward called it."""
    optimizers = optimizers or {}
    costs: list[LayerCost] = []
    flags = tuple(bool(t.requires_grad) for t in as_tuple(value)[0])
    stashed: dict[str, Tensor] = {}  # skip connections: what earlier layers stashed, for the layers that pop it
    for index, original in enumerate(layers):
        layer, layer_optimizers = _on_device(original, device, optimizers, initializer)
        if calls is not None:
            value, call = calls[index].hidden, calls[index].bind(layer, device)
            flags = tuple(t.is_floating_point() for t in as_tuple(value)[0])
        else:
            call = _with_skips(layer, stashed)
        tensors, was_tuple = as_tuple(value)
        tensors = tuple(t.detach().to(device) for t in tensors)
        forwards: list[float] = []
        backwards: list[float] = []
        saved = saved_in = saved_out = 0
        output: tuple[Tensor, ...] = ()
        params = list(layer.parameters())
        for rep in range(timing.warmup + timing.repeats):
            # a fresh non-leaf copy: layers may work in place on their input (ReLU(inplace=True))
            inputs = _inputs(tensors, flags)
            meter = SavedActivationMeter(params)
            _synchronize(device)
            start = time.perf_counter()
            with timing.context(), meter.hooks():
                out = call(from_tuple(inputs, was_tuple))
            _synchronize(device)
            middle = time.perf_counter()
            output, _ = as_tuple(out)
            saved = meter.current
            saved_in, saved_out = meter.saved_of(inputs), meter.saved_of(output)
            needing = [t for t in output if t.requires_grad]
            if needing:
                torch.autograd.backward(needing, [torch.ones_like(t) for t in needing])
            _synchronize(device)
            end = time.perf_counter()
            if rep >= timing.warmup:
                forwards.append(middle - start)
                backwards.append(end - middle)
        input_backward, weight_backward = _split_backward(layer, tensors, flags, was_tuple, device, timing, call)
        for p in params:
            p.grad = None
        parameter_bytes = sum(p.numel() * p.element_size() for p in params)
        state_bytes, update = _update_cost(params, layer_optimizers, device, timing.repeats)
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
                saved_input_bytes=saved_in,
                saved_output_bytes=saved_out,
            )
        )
        for p in params:
            p.grad = None
        flags = tuple(bool(t.requires_grad) for t in output)
        value = from_tuple(tuple(t.detach() for t in output), isinstance(out, (tuple, list)))
        if layer is original:
            layer.to(home_of(original))
    return costs


def _with_skips(layer: nn.Module, stashed: dict[str, Tensor]) -> Callable[[Any], Any]:
    """``layer`` called as a stage calls it: its pops find what earlier layers stashed (``stashed``),
    its stashes go to a scope of its own, and the last call's join ``stashed`` for later layers (each
    timed call pops and stashes anew, as each micro-batch does)."""
    stashes, pops = declared(layer)
    if not stashes and not pops:
        return layer

    def call(value: Any) -> Any:
        given = {n: stashed[n].detach().requires_grad_(stashed[n].is_floating_point()) for n in pops if n in stashed}
        with skip_scope(given) as scope:
            out = layer(value)
        stashed.update({n: scope[n].detach() for n in stashes if n in scope})
        return out

    return call


def home_of(layer: nn.Module) -> torch.device:
    """Where ``layer``'s tensors live (the CPU for a layer without any)."""
    return next(iter(layer.state_dict().values()), torch.empty(0)).device


def _on_device(
    layer: nn.Module,
    device: torch.device,
    optimizers: dict[int, tuple[type, dict[str, Any]]],
    initializer: Initializer | None = None,
) -> tuple[nn.Module, dict[int, tuple[type, dict[str, Any]]]]:
    """``layer`` on ``device`` for measuring, and the optimizer settings of its parameters. A layer
    built on the meta device is measured as a temporary copy given storage and initialised as
    its modules define it, as the pipeline will (a module that cannot be is refused as the
    pipeline refuses it; ``initializer``: the whole model's rule, so a block of a Hugging Face model
    is initialised by its ``_init_weights``)."""
    if not has_meta_tensors(layer):
        layer.to(device)
        return layer, optimizers
    initializer = Initializer() if initializer is None else initializer
    check_initializable(layer, initializer)
    real = copy.deepcopy(layer)
    allocate(list(real.modules()), device)
    reset(real, initializer=initializer.for_copy(layer, real))
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
    timing: Timing,
    call: Callable[[Any], Any] | None = None,
) -> tuple[float, float]:
    """Median seconds of B and W of ``layer``'s backward split as the zero-bubble schedules split
    it: its plain ``Linear``/``ConvNd`` layers given the runtime's deferring forward, B the backward
    inside :func:`weight_store.deferring`, W running the work it deferred (0 where nothing was)."""
    from lightning_pipe.runtime.grads import deferred_conv, fused_linear, weight_store

    installed = deferred_conv.install_split(layer)
    call = layer if call is None else call
    inputs_b: list[float] = []
    weights: list[float] = []
    try:
        for rep in range(timing.warmup + timing.repeats):
            inputs = _inputs(tensors, flags)
            with fused_linear.accumulating():
                with timing.context():
                    out = call(from_tuple(inputs, was_tuple))
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
            if rep >= timing.warmup:
                inputs_b.append(middle - start)
                weights.append(end - middle if works else 0.0)
    finally:
        deferred_conv.uninstall_split(installed)
    return statistics.median(inputs_b), statistics.median(weights)


def _map_tensors(value: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (through mappings, lists and tuples)."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return type(value)({k: _map_tensors(v, fn) for k, v in value.items()})  # type: ignore[call-arg]
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _to_meta(value: Any) -> Any:
    return _map_tensors(value, lambda t: t.to("meta"))


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
    module: Any,
    layers: nn.Sequential | nn.ModuleList,
    batch: Callable[[], Any],
    num_microbatches: int,
    device: torch.device,
    timing: Timing = Timing(),
    memory: bool = True,
    optimizers: Callable[[], Sequence[Any]] = tuple,
) -> Profile:
    """The profile of ``layers`` (the Sequential of ``module``, or a block container its forward loops
    over: see :func:`block_calls`) on ``device`` for the first micro-batch of the batch ``batch()``
    gives, each layer timed as ``timing`` says. Random states (including those the batch's draw
    consumes) and buffers are as before when it returns."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    with torch.random.fork_rng(devices=_rng_devices(device)):
        micro = split(batch(), num_microbatches)[0]
        settings = user_optimizers(optimizers) if memory else {}
        if not isinstance(layers, nn.Sequential):  # a block container the model's forward loops over
            costs, value = _profile_blocks(module, layers, micro, device, timing, settings)
        else:
            if has_meta_tensors(module):
                # built on the meta device (configure_model): the step runs there up to the Sequential,
                # which gives the shapes, and the layers, each given storage in turn, see random values
                value = _random_like(sequential_input(module, layers, _to_meta(micro)), device)
            else:
                value = sequential_input(module, layers, micro)
            costs = measure_layers(layers, value, device, timing, settings)
    with torch.no_grad():
        for name, b in module.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
    size = as_tuple(value)[0][0].shape[0] if as_tuple(value)[0][0].dim() > 0 else 1
    return Profile(tuple(costs), size, str(device), timing.repeats)


@dataclass
class BlockCall:
    """How the model's forward called one block of a block container for the profiled micro-batch:
    its hidden state (the first argument) and the rest of its arguments, all detached."""

    hidden: Any
    rest: tuple
    keywords: dict
    hidden_name: str | None = None  # the hidden state came as this keyword

    def bind(self, block: nn.Module, device: torch.device) -> Callable[[Any], Any]:
        """``block`` as a function of its hidden state, the other arguments as recorded (on ``device``)."""
        rest, keywords = _moved(self.rest, device), _moved(self.keywords, device)
        if self.hidden_name is not None:
            return lambda hidden: block(*rest, **{**keywords, self.hidden_name: hidden})
        return lambda hidden: block(hidden, *rest, **keywords)


def _moved(value: Any, device: torch.device) -> Any:
    return _map_tensors(value, lambda t: t.to(device))


def _detached(value: Any) -> Any:
    return _map_tensors(value, lambda t: t.detach())


class _Recorder(LoopedContainer):
    """Stands in for a block container while the user's step runs once: records how each block is
    called, runs it (a block built on the meta device as a temporary copy with storage), and ends
    the step after the last block, whose output it keeps. Also times what ran before the first block."""

    def __init__(
        self, blocks: Sequence[nn.Module], device: torch.device, start: float, initializer: Initializer
    ) -> None:
        super().__init__()
        self._blocks = list(blocks)  # not submodules: the model keeps its own
        self._device = device
        self._initializer = initializer
        self._start = start
        self.calls: list[BlockCall] = []
        self.first_input: Any | None = None
        self.pre_forward = 0.0
        self.output: Any = None

    def __len__(self) -> int:
        return len(self._blocks)

    def start_clock(self) -> None:
        """Time what runs before the first block from now (after the setup the step needs no more)."""
        self._start = time.perf_counter()

    def entry(self, index: int) -> Callable[..., Any]:
        return lambda *args, **kwargs: self._call(index, args, kwargs)

    def _call(self, index: int, args: tuple, kwargs: dict) -> Any:
        from lightning_pipe.runtime.blocks.container import hidden_argument

        block = self._blocks[index]
        if index == 0:
            _synchronize(self._device)
            self.pre_forward = time.perf_counter() - self._start
            self.first_input = args[0] if args else kwargs.get(hidden_argument(block))
        if args:
            self.calls.append(BlockCall(_detached(args[0]), _detached(args[1:]), _detached(kwargs)))
        else:
            name = hidden_argument(block)
            self.calls.append(
                BlockCall(_detached(kwargs[name]), (), _detached({k: v for k, v in kwargs.items() if k != name}), name)
            )
        real = _on_device(block, self._device, {}, self._initializer)[0]
        with torch.no_grad():
            out = real(*args, **kwargs)
        if index == len(self._blocks) - 1:
            self.output = _detached(out)
            raise _Captured(out)
        return out


@contextmanager
def _outside_with_storage(module: nn.Module, container: nn.Module, device: torch.device) -> Iterator[None]:
    """The modules outside ``container`` that were built on the meta device, given storage (small
    random values) while the block inputs are recorded, and put back on the meta device after."""
    inside = {id(m) for m in container.modules()}
    kept: list[tuple[nn.Module, str, Tensor]] = []
    for m in module.modules():
        if id(m) in inside:
            continue
        for name, t in list(m.named_parameters(recurse=False, remove_duplicate=False)) + list(
            m.named_buffers(recurse=False, remove_duplicate=False)
        ):
            if t.is_meta:
                kept.append((m, name, t))
    made = allocate([m for m in module.modules() if id(m) not in inside], device)
    with torch.no_grad():
        for t in made.values():
            if t.is_floating_point():
                t.normal_(0.0, 0.02)
    try:
        yield
    finally:
        for m, name, t in kept:
            setattr(m, name, t)  # a parameter stays one, a buffer keeps its persistence


def block_calls(
    module: Any, path: str, container: nn.Sequential | nn.ModuleList, microbatch: Any, device: torch.device
) -> _Recorder:
    """Run the user's ``training_step`` on ``microbatch`` once with a recorder in place of the block
    container at ``path``: each block's call (see :class:`BlockCall`), the time the step took to
    reach the first block, and the last block's output."""
    from lightning_pipe.partition.stages.split import place

    deferred = has_meta_tensors(module)
    _synchronize(device)
    recorder = _Recorder(list(container), device, time.perf_counter(), Initializer(module))
    place(module, path, recorder)
    try:
        with _outside_with_storage(module, container, device) if deferred else nullcontext():
            recorder.start_clock()
            with torch.enable_grad():
                module.training_step(microbatch, 0)
    except _Captured:
        return recorder
    except Exception as error:
        raise RuntimeError(
            "balance='time'/'memory' runs training_step on one micro-batch to record how the model calls its "
            f"blocks, and the step failed before the last block: {type(error).__name__}: {error}. Give balance "
            "as 'uniform', 'parameters' or a list of blocks per stage."
        ) from error
    finally:
        place(module, path, container)
    raise RuntimeError(
        f"balance='time'/'memory': training_step never ran the last of the {len(container)} blocks of {path}, so "
        "they cannot be profiled. The model's forward must run every block once per micro-batch."
    )


def _profile_blocks(
    module: Any,
    container: nn.Sequential | nn.ModuleList,
    microbatch: Any,
    device: torch.device,
    timing: Timing,
    optimizers: dict[int, tuple[type, dict[str, Any]]],
) -> tuple[list[LayerCost], Any]:
    """Each block measured on the arguments the model's forward gave it, and the ends' costs on the
    first and last block (see :mod:`lightning_pipe.partition.stages.ends`); and the first block's input."""
    from lightning_pipe.partition.stages.ends import find_ends

    path = next(name for name, m in module.named_modules() if m is container)
    recorder = block_calls(module, path, container, microbatch, device)
    initializer = Initializer(module)
    first = recorder.calls[0].hidden
    costs = measure_layers(container, first, device, timing, optimizers, recorder.calls, initializer)
    pre, post = _ends_cost(recorder, find_ends(module, container), device, timing, initializer)
    for p in module.parameters():
        p.grad = None
    return _with_ends(costs, pre, post), recorder.calls[0].hidden


def _ends_cost(
    recorder: _Recorder,
    ends: Any,
    device: torch.device,
    timing: Timing,
    initializer: Initializer,
) -> tuple[tuple[float, float, int], tuple[float, float, int]]:
    """(forward s, backward s, parameter bytes) of what the first stage runs before its first block
    (the step up to it, and the backward of the hidden state into the embeddings) and of the last
    stage's head (the model's output embeddings on the last block's output)."""
    pre_backward = 0.0
    first = recorder.first_input
    if isinstance(first, Tensor) and first.requires_grad:
        _synchronize(device)
        start = time.perf_counter()
        first.backward(torch.ones_like(first))
        _synchronize(device)
        pre_backward = time.perf_counter() - start
    pre_bytes = sum(p.numel() * p.element_size() for _, m in ends.pre for p in m.parameters())
    post_forward = post_backward = 0.0
    post_bytes = 0
    hidden = as_tuple(recorder.output)[0][0] if recorder.output is not None else None
    for _, head in ends.post:
        real = _on_device(head, device, {}, initializer)[0]
        post_bytes += sum(p.numel() * p.element_size() for p in real.parameters())
        forwards, backwards = [], []
        for rep in range(timing.warmup + timing.repeats):
            assert hidden is not None  # a model with a head after the blocks
            x = hidden.detach().to(device).requires_grad_(True)
            _synchronize(device)
            start = time.perf_counter()
            with timing.context():
                out = real(x)
            _synchronize(device)
            middle = time.perf_counter()
            out.backward(torch.ones_like(out))
            _synchronize(device)
            if rep >= timing.warmup:
                forwards.append(middle - start)
                backwards.append(time.perf_counter() - middle)
        for p in real.parameters():
            p.grad = None
        post_forward += statistics.median(forwards)
        post_backward += statistics.median(backwards)
    return (recorder.pre_forward, pre_backward, pre_bytes), (post_forward, post_backward, post_bytes)


def _with_ends(
    costs: list[LayerCost], pre: tuple[float, float, int], post: tuple[float, float, int]
) -> list[LayerCost]:
    """The ends' costs counted on the first and the last block, which the end stages always hold."""

    def add(cost: LayerCost, extra: tuple[float, float, int]) -> LayerCost:
        forward, backward, size = extra
        input_backward = None if cost.input_backward is None else cost.input_backward + backward
        return replace(
            cost, forward=cost.forward + forward, backward=cost.backward + backward, input_backward=input_backward,
            parameter_bytes=cost.parameter_bytes + size, gradient_bytes=cost.gradient_bytes + size,
        )  # fmt: skip

    costs = list(costs)
    costs[0] = add(costs[0], pre)
    costs[-1] = add(costs[-1], post)
    return costs


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
    answer: tuple[Profile | None, str | None] = (None, None)
    failure: BaseException | None = None
    if is_source:
        try:
            answer = (measure(), None)
        except Exception as error:  # told to every rank below, then raised here
            failure = error
            answer = (None, f"{type(error).__name__}: {error}")
    elif everywhere:
        with suppress(Exception):  # only the source's profile counts; training meets this rank's problem
            measure()
    profile, message = broadcast(answer)
    if failure is not None:
        raise failure
    if message is not None:
        raise RuntimeError(f"Profiling the layers on global rank 0 failed: {message}")
    assert profile is not None
    return profile
