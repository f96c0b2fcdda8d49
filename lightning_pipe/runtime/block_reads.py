"""Reads of blocks that run on another stage: refused, since they would train on wrong values.

Under ``module=`` a block container (:mod:`lightning_pipe.runtime.blocks`), every stage runs the
model's whole ``forward``, and the blocks of earlier stages hand their input on unchanged: only
the hidden state crosses a stage boundary. A model that reads a block's output anywhere but as the
next block's hidden state (every block's output pooled after the loop, a probe loss on block 1,
Hugging Face's ``output_hidden_states``, ``output_attentions`` or ``output_router_logits``, which
the MoE load-balancing loss reads) would read, on the stage that computes the loss, what an
earlier stage's block was *given*, or nothing at all, and would train on wrong values without a
word. Two checks stop that before any weight changes:

- the output a skipped block hands on is a fresh tensor tied to a zero marker whose gradient hook
  raises :class:`HeldBlockRead`: the loss (or anything sent on) depends on that output only if the
  model read it, since the stage's first block starts from the received hidden state instead;
- Hugging Face models (transformers 5) record hidden states, attentions and router logits with
  forward hooks on submodules of their blocks while a collector is active; a block held elsewhere
  does not run here, so its entries would be missing. A skipped block called while that collector
  records anything raises at once, in training and evaluation alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pipe.torch_internals import hf_active_output_collector

#: what each Hugging Face recording key is turned on by, and what it is used for
_HF_FLAGS = {
    "hidden_states": "output_hidden_states",
    "attentions": "output_attentions",
    "cross_attentions": "output_attentions",
    "router_logits": "output_router_logits",
}


class HeldBlockRead(RuntimeError):
    """The model read the output of a block that another pipeline stage runs."""


def _span(bounds: tuple[int, int]) -> str:
    return f"blocks {bounds[0]}..{bounds[1] - 1}"


def hf_recording() -> list[str]:
    """The outputs a Hugging Face model is recording with hooks on its submodules right now
    (``hidden_states``, ``attentions``, ``router_logits``), empty when none or without transformers."""
    collected = hf_active_output_collector()  # an older transformers collects in the loop; the marker check covers it
    return sorted(k for k in collected or {} if not k.startswith("_"))


def refuse_recorded_outputs(index: int, bounds: tuple[int, int]) -> None:
    """Raise if the model records outputs of its blocks' submodules while block ``index``, which
    another stage runs, is skipped here."""
    keys = hf_recording()
    if not keys:
        return
    span = _span(bounds)
    if keys == ["router_logits"]:
        raise HeldBlockRead(
            "The model records the router logits of every block for its MoE load-balancing loss "
            "(output_router_logits=True, passed to the call or set in the model's config), but block "
            f"{index} runs on another pipeline stage and this stage runs only {span}: the loss would see only "
            "this stage's routers and give the other stages' routers no gradient. Set output_router_logits=False "
            "(in the call and in model.config): the model then trains without its auxiliary loss, as it would "
            "without the pipeline with that setting."
        )
    flags = sorted({_HF_FLAGS.get(k, f"output_{k}") for k in keys})
    raise HeldBlockRead(
        f"The model records {', '.join(keys)} from every block with forward hooks ({' / '.join(flags)}=True, passed to "
        f"the call or set in the model's config), but block {index} runs on another pipeline stage and this stage "
        f"runs only {span}: what it records here would miss the other stages' blocks and the run would "
        "train on wrong values. Under module= only the hidden state crosses a stage boundary. Set "
        f"{' and '.join(f'{f}=False' for f in flags)} (in the call and in model.config), or compute what you need "
        "inside the blocks of the last stage, or split an nn.Sequential whose layers pass all they need on."
    )


def marked(value: Any, index: int, bounds: tuple[int, int]) -> Any:
    """What skipped block ``index`` hands on: ``value``'s floating tensors as fresh tensors (same
    values, detached from how this stage computed them), each tied to a zero marker whose gradient
    raises :class:`HeldBlockRead`. Without gradients (evaluation), ``value`` unchanged."""
    if not torch.is_grad_enabled():
        return value
    if isinstance(value, Tensor):
        return _mark(value, index, bounds)
    if isinstance(value, (tuple, list)):
        return type(value)(_mark(v, index, bounds) if isinstance(v, Tensor) else v for v in value)
    return value


def _mark(tensor: Tensor, index: int, bounds: tuple[int, int]) -> Tensor:
    if not tensor.is_floating_point():
        return tensor
    marker = torch.zeros((), dtype=tensor.dtype, device=tensor.device, requires_grad=True)

    def refuse(grad: Tensor) -> None:
        raise HeldBlockRead(
            f"The step's loss depends on the output of block {index}, which another pipeline stage runs: this stage "
            f"runs only {_span(bounds)}, and the blocks of other stages hand their input on here unchanged (under "
            "module= only the hidden state crosses a stage boundary), so the run would train on wrong values. A model "
            "that keeps blocks' outputs (pooling every block's output after the loop, a loss on an intermediate "
            "block's output, Hugging Face's output_hidden_states) must compute such values inside the blocks of the "
            "stage that reads them (the last stage's blocks, for the loss), or be split as an nn.Sequential whose "
            "layers pass all they need on. Refused before any weight changed."
        )

    marker.register_hook(refuse)
    return tensor.detach() + marker


__all__ = ["HeldBlockRead", "hf_recording", "marked", "refuse_recorded_outputs"]
