"""Penalties over parameters that every pipeline stage applies to its own parameters.

A loss term summed over parameters (an L1 or L2 penalty over ``self.parameters()``) cannot be added to
the step's loss under the pipeline: the loss runs on the last stage, which holds only its own layers
(such a term is refused, see :mod:`lightning_pipe.runtime.around.loss_terms`). Its gradient is a sum of one
term per parameter, though, and each rank can add its own parameters' part itself.
:func:`parameter_penalty` does that just before each update, on whatever the optimizer holds: in plain
training and under the pipeline alike, so both train the same; and, without gradient clipping, the same
as adding ``sum(fn(p) for p in self.parameters())`` to the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.torch_internals import wrap_optimizer_step

#: a parameter's term of the penalty: a scalar tensor computed from it
Term = Callable[[Tensor], Tensor]


def parameter_penalty(optimizer: torch.optim.Optimizer, fn: Term) -> torch.optim.Optimizer:
    """Add the gradient of ``fn(p)`` to the gradient of every parameter ``p`` that ``optimizer`` updates,
    just before each of its updates (after Lightning's closure has run the step, its backward and gradient
    clipping); returns ``optimizer``. A parameter without a gradient (frozen, or unused this step) is left
    as it is. For optimizers that call the closure once (not LBFGS).

    Write it in ``configure_optimizers``::

        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return lightning_pipe.parameter_penalty(opt, lambda p: 1e-4 * p.abs().sum())
    """

    def wrapped(original: Callable[[], Any]) -> Callable[..., Any]:
        def step(closure: Callable[[], Any] | None = None) -> Any:
            loss = None
            if closure is not None:  # Lightning's closure: the step, its backward and clipping
                with torch.enable_grad():
                    loss = closure()
            add_penalty_gradients(optimizer, fn)
            original()
            return loss

        return step

    wrap_optimizer_step(optimizer, wrapped)
    return optimizer


def add_penalty_gradients(optimizer: torch.optim.Optimizer, fn: Term) -> None:
    """Add ``fn``'s gradient to that of every parameter of ``optimizer`` that has one."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            with torch.enable_grad():
                leaf = param.detach().requires_grad_(True)
                (grad,) = torch.autograd.grad(fn(leaf), leaf)
            param.grad.add_(grad.to(param.grad.dtype))
