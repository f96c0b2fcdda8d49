"""Reads of blocks that run on another stage: refused, since they would train on wrong values.

Under ``module=`` a block container (:mod:`lightning_pipe.runtime.blocks.container`), every stage runs the
model's whole ``forward``, and the blocks of earlier stages hand their input on unchanged: only
the hidden state crosses a stage boundary. A model that reads a block's output anywhere but as the
next block's hidden state (every block's output pooled after the loop, a probe loss on block 1,
Hugging Face's ``output_hidden_states``, ``output_attentions`` or ``output_router_logits``, which
the MoE load-balancing loss reads) would read, on the stage that computes the loss, what an
earlier stage's block was *given*, or nothing at all, and would train on wrong values without a
word. Two checks stop that before any weight changes, in training and evaluation alike:

- the output a skipped block hands on is a :class:`HeldOutput`, and so is everything computed from
  it (detached or not): passed to the next block it is no read (the stage's first block starts
  from the received hidden state instead), but where it reaches one of this stage's blocks, what
  the stage sends on, the step's loss, a logged value or an evaluation step's output
  (:func:`refuse_held`), :class:`HeldBlockRead` is raised in the first micro-batch's forward, and
  at once where it is read into Python (``.item()``, ``float()``) or written into another tensor;
- Hugging Face models (transformers 5) record hidden states, attentions and router logits with
  forward hooks on submodules of their blocks while a collector is active; a block held elsewhere
  does not run here, so its entries would be missing. A skipped block called while that collector
  records anything raises at once, in training and evaluation alike; except hidden states,
  attention weights and an MoE model's router logits, which cross stages with the micro-batch
  (:mod:`lightning_pipe.runtime.crossing.carried`) under the schedules that carry them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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


def refuse_recorded_outputs(index: int, bounds: tuple[int, int], keys: list[str]) -> None:
    """Raise if the model records outputs of its blocks' submodules (``keys``, as :func:`hf_recording`
    gives them, less the router logits that cross stages) while block ``index``, which another stage
    runs, is skipped here."""
    if not keys:
        return
    span = _span(bounds)
    flags = sorted({_HF_FLAGS.get(k, f"output_{k}") for k in keys})
    raise HeldBlockRead(
        f"The model records {', '.join(keys)} from every block with forward hooks ({' / '.join(flags)}=True, passed to "
        f"the call or set in the model's config), but block {index} runs on another pipeline stage and this stage "
        f"runs only {span}: what it records here would miss the other stages' blocks and the run would "
        "train on wrong values. Under module= only the hidden state and the recorded hidden_states, attentions, "
        "cross_attentions and router_logits cross a stage boundary. Set "
        f"{' and '.join(f'{f}=False' for f in flags)} (in the call and in model.config), or compute what you need "
        "inside the blocks of the last stage, or split an nn.Sequential whose layers pass all they need on."
    )


#: reads that turn a tensor into Python values: refused at once, the value leaving every later check
_PYTHON_READS = frozenset(
    {Tensor.item, Tensor.tolist, Tensor.numpy, Tensor.__bool__, Tensor.__float__, Tensor.__int__, Tensor.__index__,
     Tensor.__complex__, Tensor.__array__}
)  # fmt: skip


class HeldOutput(Tensor):
    """What a skipped block hands on: its hidden state (the value it was given), standing for the
    output of a block that another stage runs. Everything computed from it is a ``HeldOutput`` too
    (``blocks``: the skipped blocks it comes from), so a read shows wherever it ends up: as an
    argument of this stage's blocks, as what this stage sends on, in the step's loss, a logged value
    or an evaluation step's output (:func:`refuse_held`); a read into Python values or a write into
    another tensor is refused at once. Passed to the next block (skipped, or this stage's first,
    which runs on the received hidden state instead), it is no read."""

    blocks: frozenset[int]
    bounds: tuple[int, int]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        sources = _held_in((args, kwargs))
        if func in _PYTHON_READS:
            raise HeldBlockRead(_read_message(f"The step reads into Python ({func.__name__}) a value that", sources))
        written = _written(func, args, kwargs)
        if written is not None and not isinstance(written, HeldOutput):
            raise HeldBlockRead(
                _read_message(f"The step writes ({func.__name__}) into another tensor a value that", sources)
            )
        result = super().__torch_function__(func, types, args, kwargs)
        blocks, bounds = _blocks(sources), next((t.bounds for t in sources if hasattr(t, "bounds")), (0, 0))
        for tensor in tensors_in(result):
            if isinstance(tensor, HeldOutput):
                tensor.blocks, tensor.bounds = blocks, bounds
        return result


def _written(func: Any, args: tuple, kwargs: dict) -> Any:
    """The tensor ``func`` writes into (an in-place method's ``self``, ``out=``), or None."""
    if "out" in kwargs:
        return kwargs["out"]
    name = getattr(func, "__name__", "")
    if name in _WRITES or (name.endswith("_") and not name.startswith("_")):
        return args[0] if args else None
    return None


#: the methods that write into their first argument besides those named ``..._``
_WRITES = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
     "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}
)  # fmt: skip


def tensors_in(value: Any) -> list[Tensor]:
    """The tensors in ``value``: a tensor, in tuples, lists and mappings (a Hugging Face output)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def _held_in(value: Any) -> list[HeldOutput]:
    return [t for t in tensors_in(value) if isinstance(t, HeldOutput)]


def _blocks(held: list[HeldOutput]) -> frozenset[int]:
    return frozenset().union(*(getattr(t, "blocks", frozenset()) for t in held))


def _read_message(what: str, held: list[HeldOutput]) -> str:
    bounds = next((t.bounds for t in held if hasattr(t, "bounds")), (0, 0))
    block = min(_blocks(held), default=0)
    return (
        f"{what} depends on the output of block {block}, which another pipeline stage runs: this stage runs only "
        f"{_span(bounds)}, and the blocks of other stages hand their input on here unchanged (under module= only "
        "the hidden state crosses a stage boundary), so the run would train or evaluate on wrong values. A model "
        "that keeps blocks' outputs (pooling every block's output after the loop, a loss, a probe or a statistic of "
        "an intermediate block's output, Hugging Face's output_hidden_states) must compute such values inside the "
        "blocks of the stage that reads them (the last stage's blocks, for the loss), or be split as an "
        "nn.Sequential whose layers pass all they need on. Refused before any weight changed."
    )


def refuse_held(value: Any, what: str) -> None:
    """Raise :class:`HeldBlockRead` if ``value`` (tensors, in tuples, lists and mappings) holds a
    value computed from the output of a block that another stage runs; ``what``: how the message
    names it (``"The step's loss"``)."""
    held = _held_in(value)
    if held:
        raise HeldBlockRead(_read_message(what, held))


def held(value: Any, index: int, bounds: tuple[int, int]) -> Any:
    """What skipped block ``index`` hands on: ``value``'s tensors as :class:`HeldOutput` (same values,
    detached from how this stage computed them)."""
    if isinstance(value, Tensor):
        return _hold(value, index, bounds)
    if isinstance(value, (tuple, list)):
        return type(value)(_hold(v, index, bounds) if isinstance(v, Tensor) else v for v in value)
    return value


def _hold(tensor: Tensor, index: int, bounds: tuple[int, int]) -> Tensor:
    out = tensor.detach().as_subclass(HeldOutput)
    out.blocks, out.bounds = frozenset({index}), bounds
    return out
