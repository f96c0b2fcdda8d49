"""Loss terms over the pipelined layers' parameters, read in the step outside the pipelined call: refused.

The step's loss runs on the last stage only, which holds only its own layers: an L2 penalty over
``self.parameters()``, or a term on ``self.layers[7].weight``, would there cover the last stage's
layers alone, and the other stages' part of it would be dropped without a word. The loss's autograd
graph shows such a term: it reaches a layer's parameter (its ``AccumulateGrad`` node) other than
through the outputs of the layers this stage ran. The first training micro-batch of a run checks it,
before any update, and the refusal says how to write the term instead
(:func:`lightning_pipe.penalties.parameter_penalty`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor


class ParameterTermRefused(RuntimeError):
    """The step's loss reads the pipelined layers' parameters outside the pipelined call."""


def read_directly(loss: Tensor, through: Sequence[Tensor], params: Iterable[tuple[str, Tensor]]) -> list[str]:
    """The names of ``params`` whose gradient node ``loss``'s graph reaches other than through the graph of
    ``through`` (what the stage's layers returned), in the order given."""
    wanted = {id(p): name for name, p in params}
    if loss.grad_fn is None or not wanted:
        return []
    stops = {id(t.grad_fn) for t in through if t.grad_fn is not None}
    seen: set[int] = set()
    found: set[int] = set()
    todo = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if id(node) in seen or id(node) in stops:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in wanted:
            found.add(id(variable))
        todo.extend(child for child, _ in node.next_functions if child is not None)
    return [name for key, name in wanted.items() if key in found]


def refuse_parameter_terms(loss: Tensor, through: Sequence[Tensor], params: Iterable[tuple[str, Tensor]]) -> None:
    """Raise :class:`ParameterTermRefused` where ``loss`` reads any of ``params`` (this stage's layers'
    parameters, by name) other than through ``through``."""
    names = read_directly(loss, through, params)
    if not names:
        return
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    raise ParameterTermRefused(
        f"The step's loss reads parameters of the pipelined layers other than through the pipelined call ({shown}): "
        "a penalty over self.parameters() or a term on one layer's weight. Under the pipeline the loss runs on the "
        "last stage, which holds only its own layers, so the other stages' part of such a term would be dropped. "
        "Write a sum of per-parameter terms with lightning_pipe.parameter_penalty(optimizer, fn) in "
        "configure_optimizers (each stage adds the term's gradient for its own parameters before each update, the "
        "same in plain training), an L2 term as the optimizer's weight_decay, or compute the term inside a layer. "
        "Refused before any weight changed."
    )
