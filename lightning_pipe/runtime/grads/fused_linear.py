"""Gradient-accumulation fusion for ``nn.Linear``: each micro-batch's weight gradient is added
into ``weight.grad`` by the matrix product itself.

A pipeline runs a batch as m micro-batches, so every weight gradient is accumulated m times.
Autograd computes each micro-batch's ``dW = g^T x`` into a fresh tensor (allocated, and on CPUs
faulted in page by page) and then adds it to ``weight.grad``: two extra passes over a weight-sized
tensor per layer and micro-batch. Here the backward of a ``Linear`` writes ``dW`` straight into
``weight.grad`` (``addmm_`` with beta 1; the first micro-batch's product becomes ``weight.grad``), as
Megatron-LM's ``gradient_accumulation_fusion`` does. The gradients are those of autograd.

Under a split backward (zero-bubble schedules) the same layers defer their weight-gradient
product to the schedule's W action (:mod:`lightning_pipe.runtime.grads.weight_store`): B computes only
``grad @ W``. With ``accumulating(fuse=False)`` the deferred product is computed into a new
tensor and added, as autograd would.

The fused path is taken only while :func:`accumulating` is active (the pipeline's training steps)
and only where autograd's result would be identical: gradient mode on, a trainable leaf weight
(the parameter, or a stashed weight version passed through ``functional_call``, whose ``.grad`` is
where autograd would put the gradient too) without gradient hooks, no autocast, matching dtypes.
Everything else (evaluation, mixed precision, a weight computed from other tensors) runs
``F.linear`` unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from lightning_pipe.runtime.grads.flat import add_grad
from lightning_pipe.runtime.grads.replica_grads import HOOK_TAG
from lightning_pipe.runtime.grads.weight_store import defer_or_run
from lightning_pipe.torch_internals import backward_hooks, instance_forward, post_accumulate_grad_hooks, set_forward

_active = False
_fuse = True


@contextmanager
def accumulating(fuse: bool = True) -> Iterator[None]:
    """Take the installed layers' own backward while the block runs (forwards and backwards):
    the weight gradient added into ``.grad`` by the product itself (``fuse``), or computed and
    added (only worth it where the product is deferred to a W action)."""
    global _active, _fuse
    previous = _active, _fuse
    _active, _fuse = True, fuse
    try:
        yield
    finally:
        _active, _fuse = previous


class _LinearAccumulate(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight and bias gradients into ``.grad`` itself."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.parameters = (weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        weight_param, bias = ctx.parameters
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        want_weight = ctx.needs_input_grad[1]
        want_bias = bias is not None and ctx.needs_input_grad[2]
        if want_weight or want_bias:
            defer_or_run(
                partial(
                    _weight_grad, x, grad, weight_param if want_weight else None, bias if want_bias else None, _fuse
                )
            )
        return grad_x, None, None


def _weight_grad(x: Tensor, grad: Tensor, weight: Tensor | None, bias: Tensor | None, fuse: bool) -> None:
    """``dW = g^T x`` and ``db = sum(g)`` into ``.grad``: added by the product itself with ``fuse``."""
    g = grad.reshape(-1, grad.shape[-1])
    if weight is not None:
        x2 = x.reshape(-1, x.shape[-1])
        if weight.grad is None or not fuse:
            add_grad(weight, g.t().mm(x2))
        else:
            weight.grad.addmm_(g.t(), x2)
    if bias is not None:
        add_grad(bias, g.sum(0))


def _plain_leaf(param: Tensor | None) -> bool:
    """A leaf whose gradient autograd would put in ``.grad``, with nothing observing it on the way."""
    if param is None:
        return True
    if not param.is_leaf:
        return False
    # the data-parallel readiness hooks only count accumulations; they run after the fused product too
    observing = [h for h in post_accumulate_grad_hooks(param).values() if not getattr(h, HOOK_TAG, False)]
    return not backward_hooks(param) and not observing


def fusable(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether a layer may take its own backward here: its result must equal autograd's."""
    return (
        _active
        and torch.is_grad_enabled()
        and weight.requires_grad
        and x.dtype == weight.dtype
        and not torch.is_autocast_enabled(x.device.type)
        and _plain_leaf(weight)
        and _plain_leaf(bias)
    )


class _Forward:
    """The forward installed on one layer (an instance attribute, so the class stays ``nn.Linear``)."""

    __slots__ = ("layer",)

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer

    def __call__(self, x: Tensor) -> Tensor:
        weight, bias = self.layer.weight, self.layer.bias
        if fusable(x, weight, bias):
            return _LinearAccumulate.apply(x, weight, bias)
        return F.linear(x, weight, bias)


def install_forward(module: nn.Module, eligible: Callable[[nn.Module], bool], forward: type) -> list[nn.Module]:
    """Give every ``eligible`` layer of ``module`` the instance forward ``forward(layer)`` (a layer
    given its own forward by someone else is left alone); returns the layers that have it."""
    layers: list[nn.Module] = []
    for layer in module.modules():
        if not eligible(layer):
            continue
        installed = instance_forward(layer)
        if installed is None:
            set_forward(layer, forward(layer))
        elif not isinstance(installed, forward):
            continue
        layers.append(layer)
    return layers


def uninstall_forward(layers: list[nn.Module], forward: type) -> None:
    """Give the layers back their own forward."""
    for layer in layers:
        if isinstance(instance_forward(layer), forward):
            set_forward(layer, None)


def install(module: nn.Module) -> list[nn.Module]:
    """Give every plain ``nn.Linear`` in ``module`` the fused forward (subclasses, which may compute
    something else, keep theirs). Returns the layers that have it, for :func:`uninstall`."""
    return install_forward(module, lambda layer: type(layer) is nn.Linear, _Forward)


def uninstall(layers: list[nn.Module]) -> None:
    """Give the layers back their own forward."""
    uninstall_forward(layers, _Forward)
