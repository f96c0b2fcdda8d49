"""Convolutions whose weight gradient waits for a split backward's W action.

In a zero-bubble schedule's B, a plain ``nn.Conv1d/2d/3d`` computes only its input gradient
(``aten.convolution_backward`` with the weight and bias outputs masked off) and hands the
weight and bias gradients to :mod:`lightning_pipe.runtime.grads.weight_store`, to be computed in W
from the layer's input and output gradient. Installed only for schedules with a split backward:
elsewhere autograd's single ``convolution_backward`` is as fast. The same conditions as for
:mod:`lightning_pipe.runtime.grads.fused_linear` apply (training steps only, a plain trainable leaf
weight, no autocast, matching dtypes, zero padding mode); everything else runs the layer's own
forward.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from lightning_pipe.runtime.grads import fused_linear
from lightning_pipe.runtime.grads.flat import add_grad
from lightning_pipe.runtime.grads.weight_store import defer_or_run

_Conv = nn.Conv1d | nn.Conv2d | nn.Conv3d
_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_FUNCTIONS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}


def _convolve(layer: _Conv, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The layer's convolution with zero padding (the only padding mode installed), as its forward runs it."""
    return _FUNCTIONS[type(layer)](x, weight, bias, layer.stride, layer.padding, layer.dilation, layer.groups)


class _ConvDeferred(torch.autograd.Function):
    """A convolution whose backward computes the input gradient now and the rest in W."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, layer: _Conv) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.parameters = (weight, bias)
        ctx.layer = layer
        return _convolve(layer, x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        weight_param, bias = ctx.parameters
        layer = ctx.layer
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _conv_backward(layer, grad, x, weight, bias, (True, False, False))[0]
        want_weight = ctx.needs_input_grad[1]
        want_bias = bias is not None and ctx.needs_input_grad[2]
        if want_weight or want_bias:
            mask = (False, want_weight, want_bias)
            defer_or_run(partial(_weight_grad, layer, grad, x, weight, weight_param, bias, mask))
        return grad_x, None, None, None


def _conv_backward(
    layer: _Conv, grad: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, mask: tuple[bool, bool, bool]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    return torch.ops.aten.convolution_backward(
        grad,
        x,
        weight,
        [bias.shape[0]] if bias is not None else None,
        list(layer.stride),
        list(layer.padding),
        list(layer.dilation),
        False,
        [0] * len(layer.stride),
        layer.groups,
        list(mask),
    )


def _weight_grad(
    layer: _Conv,
    grad: Tensor,
    x: Tensor,
    weight: Tensor,
    weight_param: Tensor,
    bias: Tensor | None,
    mask: tuple[bool, bool, bool],
) -> None:
    _, grad_weight, grad_bias = _conv_backward(layer, grad, x, weight, bias, mask)
    if grad_weight is not None:
        add_grad(weight_param, grad_weight)
    if grad_bias is not None and bias is not None:
        add_grad(bias, grad_bias)


class _Forward:
    """The forward installed on one convolution (an instance attribute: the class stays)."""

    __slots__ = ("layer",)

    def __init__(self, layer: _Conv) -> None:
        self.layer = layer

    def __call__(self, x: Tensor) -> Tensor:
        layer = self.layer
        if fused_linear.fusable(x, layer.weight, layer.bias):
            return _ConvDeferred.apply(x, layer.weight, layer.bias, layer)
        return _convolve(layer, x, layer.weight, layer.bias)


def _eligible(layer: nn.Module) -> bool:
    return type(layer) in _TYPES and layer.padding_mode == "zeros" and not isinstance(layer.padding, str)


def install(module: nn.Module) -> list[nn.Module]:
    """Give every plain convolution with zero padding and explicit padding sizes the deferring
    forward; returns the layers that have it, for :func:`uninstall`."""
    return fused_linear.install_forward(module, _eligible, _Forward)


def uninstall(layers: list[nn.Module]) -> None:
    """Give the layers back their own forward."""
    fused_linear.uninstall_forward(layers, _Forward)


def install_split(module: nn.Module) -> list[nn.Module]:
    """The forwards a split backward runs with: every plain ``nn.Linear`` and convolution of
    ``module`` defers its weight-gradient product to W. Returns the layers, for :func:`uninstall_split`."""
    return fused_linear.install(module) + install(module)


def uninstall_split(layers: list[nn.Module]) -> None:
    """Give the layers of :func:`install_split` (or of :func:`fused_linear.install`) back their forward."""
    fused_linear.uninstall(layers)
    uninstall(layers)
