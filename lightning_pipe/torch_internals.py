"""Every private name of torch and Hugging Face ``transformers`` the core reaches, one function each.

The core (``schedules/``, ``partition/``, ``runtime/``, ``checkpoint/``, ``weights/``, ``plan/``)
calls these instead of touching another package's ``_name``; ``tests/test_imports.py`` refuses such
a name anywhere else but here and in :mod:`lightning_pipe.trainer.internals` (the Trainer's side).
A leaf: it imports torch only (``transformers`` inside a function, when it is there), so every layer
may use it. Each function says what it touches, why no public API serves, and the versions it was
checked with (torch 2.13, transformers 5.24, Lightning 2.6); a new release that moves one of these
fails here, in one place.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer


def module_slots(parent: nn.Module) -> list[tuple[str, nn.Module | None]]:
    """Every direct child slot of ``parent`` (``nn.Module._modules``), a child held under two names
    listed under each and empty slots included. ``named_children()`` yields a module once, under
    its first name, so replacing a module there would leave its second name holding it (and its
    tensors). Writes go through ``setattr``. Checked with torch 2.13."""
    return list(parent._modules.items())


def filled_slots(parent: nn.Module) -> dict[str, nn.Module]:
    """:func:`module_slots` without the empty ones, in order, as ``nn.Sequential`` runs them: every
    child under each of its names (``named_children()`` gives a child once). Checked with torch 2.13."""
    return {name: child for name, child in parent._modules.items() if child is not None}


def child_slot(parent: nn.Module, name: str) -> nn.Module | None:
    """The direct child of ``parent`` in slot ``name`` (``nn.Module._modules.get``); None when there
    is none or the slot is empty. ``get_submodule`` raises for a missing one and ``getattr`` also finds
    parameters and buffers; this runs for every block call of every micro-batch. Checked with torch 2.13."""
    return parent._modules.get(name)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` (same classes, same plain attributes, submodules copied alike) whose
    parameters, buffers and tensor attributes are on the meta device, with no hooks: what another
    stage's block answers structural reads from, holding no memory. ``copy.deepcopy`` would copy the
    tensors first, and the hooks' owners with them; this fills each copy's ``__dict__`` (``_parameters``,
    ``_buffers``, ``_modules``, the ``_..._hooks`` dicts emptied) instead. A tensor or module met twice
    (tied) is copied once. Checked with torch 2.13."""
    seen: dict[int, Any] = {}

    def meta(tensor: Tensor | None) -> Tensor | None:
        if tensor is None:
            return None
        if id(tensor) not in seen:
            empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            param = isinstance(tensor, nn.Parameter)
            seen[id(tensor)] = nn.Parameter(empty, requires_grad=tensor.requires_grad) if param else empty
        return seen[id(tensor)]

    def copy(original: nn.Module) -> nn.Module:
        if id(original) in seen:
            return seen[id(original)]
        new = object.__new__(type(original))
        seen[id(original)] = new
        state = {}
        for key, value in vars(original).items():
            if key.startswith("_") and "_hooks" in key and isinstance(value, dict):  # _forward_hooks ...
                value = type(value)()
            elif isinstance(value, Tensor):
                value = meta(value)
            elif isinstance(value, set):
                value = set(value)  # _non_persistent_buffers_set
            state[key] = value
        state["_parameters"] = {k: meta(v) for k, v in original._parameters.items()}
        state["_buffers"] = {k: meta(v) for k, v in original._buffers.items()}
        state["_modules"] = {k: None if m is None else copy(m) for k, m in original._modules.items()}
        new.__dict__.update(state)
        return new

    return copy(module)


def nested_from_mask(padded: Tensor, valid: Tensor) -> Tensor:
    """The nested tensor of ``padded``'s rows (batch first) where ``valid`` is True, left-aligned
    (``torch._nested_tensor_from_mask``, as ``nn.TransformerEncoder``'s fast path builds it, so the
    layers run the same kernels on it). The public ``torch.nested`` constructors build it otherwise.
    Checked with torch 2.13."""
    return _NESTED_FROM_MASK(padded, valid, mask_check=False)  # as imported: not noted by nested_from_mask_shapes


_NESTED_FROM_MASK = torch._nested_tensor_from_mask


@contextmanager
def nested_from_mask_shapes(seen: list[tuple[int, ...]]) -> Iterator[None]:
    """While open, the padded shape of every nested tensor torch builds from a mask is appended to
    ``seen``: ``nn.TransformerEncoder``'s fast path (evaluation with a padding mask) turns its input
    into a nested tensor with ``torch._nested_tensor_from_mask``, and the padded shape it came from
    (its sequence length above the longest sample's) is known nowhere else. Replaces that function,
    which the encoder reads from ``torch`` at each call. Checked with torch 2.13."""
    original = torch._nested_tensor_from_mask

    def recorded(padded: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        seen.append(tuple(padded.shape))
        return original(padded, *args, **kwargs)

    torch._nested_tensor_from_mask = recorded  # type: ignore[assignment]
    try:
        yield
    finally:
        torch._nested_tensor_from_mask = original


def forward_hooks(module: nn.Module) -> list[Callable[..., Any]]:
    """The forward hooks and forward pre-hooks registered on ``module`` itself (``_forward_hooks``,
    ``_forward_pre_hooks``; not the global ones). Checked with torch 2.13."""
    return [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]


def wrap_optimizer_step(optimizer: Optimizer, wrapper: Callable[[Callable[[], Any]], Callable[..., Any]]) -> None:
    """Give ``optimizer`` the instance ``step`` ``wrapper(original)``, where ``original()`` runs its
    step without a closure (``optimizer.step = ...``, which Lightning's precision plugins call with their
    closure). A bound method, as the class's: torch's LR schedulers wrap ``step.__func__``. Checked with torch
    2.13."""
    stepped = wrapper(optimizer.step)

    def step(self: Optimizer, *args: Any, **kwargs: Any) -> Any:
        return stepped(*args, **kwargs)

    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]


def instance_forward(layer: nn.Module) -> Any | None:
    """The forward set on this one module (``layer.__dict__["forward"]``, see :func:`set_forward`);
    None when it runs its class's. Checked with torch 2.13."""
    return layer.__dict__.get("forward")


def set_forward(layer: nn.Module, forward: Callable[..., Any] | None) -> None:
    """Give ``layer`` the instance forward ``forward`` (``layer.forward = forward``, which
    ``nn.Module.__call__`` runs in place of its class's), or with None its class's again
    (``del layer.forward``). One layer changes while its class stays (``type(layer) is nn.Linear``
    holds, its state dict is the same); a forward hook runs around the forward, never instead of
    it. Checked with torch 2.13."""
    if forward is not None:
        layer.forward = forward
    elif "forward" in layer.__dict__:
        del layer.forward


def hf_init_weights(owner: nn.Module, module: nn.Module) -> None:
    """Initialise ``module``'s tensors with ``owner._init_weights`` (``owner``: its enclosing
    ``PreTrainedModel``). The public ``init_weights()`` / ``initialize_weights()`` walk the whole
    model; a stage built on the meta device initialises only its own modules, one at a time.
    Checked with transformers 5.24."""
    owner._init_weights(module)  # type: ignore[operator]


def private_reset_parameters(module: nn.Module) -> Callable[[], None] | None:
    """``module._reset_parameters`` where a torch module has no public ``reset_parameters``
    (``nn.MultiheadAttention``, ``nn.Transformer``): their only way to initialise their own
    tensors again. Checked with torch 2.13."""
    reset = getattr(module, "_reset_parameters", None)
    return reset if callable(reset) else None


def hf_active_output_collector() -> Mapping[str, Any] | None:
    """What a Hugging Face model is recording with hooks on its submodules right now
    (``transformers.utils.output_capturing._active_collector``: ``hidden_states``, ``attentions``
    ...); None when nothing records, without transformers or with an older one (which collects in
    its loop). ``transformers`` has no public way to ask. Checked with transformers 5.24."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector.get()


def hf_forced_hidden_states_calls() -> list[tuple[Any, Any]]:
    """The calls under way, innermost first, of forwards wrapped by transformers'
    ``filter_output_hidden_states`` (``transformers.backbone_utils``), each as the model and what its
    caller asked for ``output_hidden_states``: the wrapper turns the recording on whatever was asked
    and keeps that only in its local ``output_hidden_states``, read here from its frame (the wrapper
    copies the forward's name, so its frames are told by its code). transformers has no public way
    to ask. Empty without transformers. Checked with transformers 5.24."""
    if "transformers" not in sys.modules:
        return []
    try:
        from transformers.backbone_utils import filter_output_hidden_states
    except ImportError:
        return []
    code = filter_output_hidden_states(lambda self: None).__code__
    calls = []
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is code:
            calls.append((frame.f_locals.get("self"), frame.f_locals.get("output_hidden_states")))
        frame = frame.f_back
    return calls


def backward_hooks(tensor: Tensor) -> Mapping[Any, Any]:
    """The hooks ``tensor.register_hook`` put on ``tensor`` (``Tensor._backward_hooks``; empty when
    none). torch offers registering and removing a hook, not asking whether one is there, and a
    fused backward must not bypass an observer. Checked with torch 2.13."""
    return tensor._backward_hooks or {}


def post_accumulate_grad_hooks(tensor: Tensor) -> Mapping[Any, Any]:
    """The hooks ``register_post_accumulate_grad_hook`` put on ``tensor``
    (``Tensor._post_accumulate_grad_hooks``; empty when none), for the same reason as
    :func:`backward_hooks`. Checked with torch 2.13."""
    return getattr(tensor, "_post_accumulate_grad_hooks", None) or {}


def version(tensor: Tensor) -> int:
    """``tensor._version``: autograd's counter of in-place changes, the only record of whether a
    forward wrote into a buffer (comparing values would copy every buffer). Checked with torch 2.13."""
    return tensor._version


def fsdp_post_backward(module: Any) -> None:
    """Run FSDP2's post-backward on the ``fully_shard`` module ``module`` and its inner states now:
    reduce-scatter the accumulated gradients and free the gathered parameters
    (``FSDPState._state_ctx.all_states``, each state's ``_fsdp_param_groups``' ``post_backward``,
    ``_root_post_backward_final_callback``). FSDP2 runs these from autograd hooks of a backward it
    sees whole; a pipeline runs many micro-batch backwards, as
    ``torch.distributed.pipelining.stage`` does, which calls the same internals. Checked with
    torch 2.13."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]  # set by torch's @contract
    for inner in state._state_ctx.all_states:
        for group in inner._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def fsdp_init_grouped_root(module: Any) -> None:
    """Make the ``fully_shard([a, b, ...])`` state of ``module`` (one of its modules, ``a``) the root of
    itself now. FSDP2 makes the first state to run forward a root and refuses a root that groups several
    modules ("requires a single root module"); a pipeline stage's units are each their own root (a stage
    runs them one by one, not under one module's forward), a group of modules sharing a weight (an
    encoder-decoder's embedding) too. Runs ``FSDPState._lazy_init`` with the group's first module as its
    only one (``_modules``, restored after), which gathers the group's state and those nested in that
    module. Call it after every ``fully_shard`` of the stage, for a group inside no other unit. Checked
    with torch 2.13."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]  # set by torch's @contract
    if state._is_root is not None:
        return
    modules = state._modules
    state._modules = modules[:1]
    try:
        state._lazy_init()
    finally:
        state._modules = modules


def lightning_wrapped_batch_sampler(sampler: Any) -> Any | None:
    """The batch sampler Lightning's ``_IndexBatchSamplerWrapper`` (prediction) wraps
    (``_batch_sampler``), read by name so that the core imports no Lightning; None for any other
    sampler. The wrapper has no public accessor. Checked with Lightning 2.6."""
    return getattr(sampler, "_batch_sampler", None)


@contextmanager
def optimizers_over_nothing(built: list[Optimizer], emptied: list[Optimizer]) -> Iterator[None]:
    """While open, an optimizer handed an empty parameter list gets one empty parameter group
    instead of torch's ``ValueError: optimizer got an empty parameter list`` (each optimizer built
    is added to ``built``, one built over nothing to ``emptied`` too). Replaces
    ``torch.optim.Optimizer.__init__``, which every optimizer calls with its parameters: the
    user's ``configure_optimizers`` builds the optimizer, and torch has no switch for an empty one.
    An optimizer over an empty group steps, zeroes and saves its (empty) state as usual. Checked
    with torch 2.13."""
    original = Optimizer.__init__

    def init(self: Optimizer, params: Any, defaults: dict[str, Any]) -> None:
        if not isinstance(params, Tensor):
            params = list(params)
            if not params:
                params = [{"params": []}]
                emptied.append(self)
        original(self, params, defaults)
        built.append(self)

    Optimizer.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        Optimizer.__init__ = original  # type: ignore[method-assign]
