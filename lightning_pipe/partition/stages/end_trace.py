"""Which of a model's own modules only the first or only the last stage needs, found by running one step.

A Hugging Face model names its embeddings (see :mod:`lightning_pipe.partition.stages.ends`); a model of the user's
own (a character-level GPT's ``tok_emb``, ``pos_emb``, ``ln_f`` and ``head`` around ``blocks``) does not, so one
micro-batch of the run's own step is traced before the split. The candidates are the modules beside the split
layers (the children of each module on the path to them); for each, the trace records when its parameters are read
(inside its own call, or directly by the model's code) and the tensors computed from them before the first layer:

- a module whose parameters are read only before the first layer runs, and whose results reach the layers only
  through the first layer's input (the hidden state the next stages replace by what they receive), belongs to the
  first stage;
- a module whose parameters are read only after the last layer ran belongs to the last stage;
- every other module stays on every stage, with the reason: read both before and after the layers (an embedding
  used again as the head's weight), read while the layers run, its result read past the first layer's input
  (a skip from the embeddings to the head), or never read in the traced step.

Nothing here is distributed; the caller runs the step (restoring the random state and the buffers) and gives every
rank the same answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_pipe.runtime.blocks.reads import tensors_in

Phase = Literal["before", "during", "after"]

#: reads of a tensor's structure only, which a stand-in's zeros answer as the real tensor would
_STRUCTURE = {Tensor.size, Tensor.dim, Tensor.shape.__get__, Tensor.dtype.__get__, Tensor.device.__get__}  # type: ignore[attr-defined]


@dataclass(frozen=True)
class TracedEnds:
    """What one traced step found: the module paths for the first and the last stage, and for each other candidate
    holding parameters why it stays on every stage (``failed``: why nothing could be traced)."""

    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    kept: tuple[tuple[str, str], ...] = ()
    failed: str | None = None


def end_candidates(module: nn.Module, container: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules beside ``container`` in ``module``: the children of every module on the path to it (that path
    and ``container`` excluded), with their paths; those holding parameters outside ``container`` only."""
    path = next(name for name, m in module.named_modules() if m is container)
    inside = {id(p) for p in container.parameters()}
    ancestors, found = [("", module)], []
    for part in path.split("."):
        prefix, owner = ancestors[-1]
        ancestors.append((f"{prefix}{part}.", getattr(owner, part)))
    on_path = {id(m) for _, m in ancestors}
    for prefix, owner in ancestors[:-1]:
        for key, child in owner.named_children():
            if id(child) in on_path:
                continue
            params = list(child.parameters())
            if params and not any(id(p) in inside for p in params):
                found.append((f"{prefix}{key}", child))
    return found


@dataclass
class _Record:
    """The trace's state while the step runs."""

    holders: dict[int, list[int]]  # parameter id -> the candidates holding it
    phase: Phase = "before"
    active: list[int] = field(default_factory=list)  # the candidates being called, outermost first
    used: dict[int, set[Phase]] = field(default_factory=dict)
    derived: dict[int, tuple[Tensor, frozenset[int]]] = field(default_factory=dict)  # before: id -> tensor, sources
    crossing: set[int] = field(default_factory=set)  # the first layer's input
    first: nn.Module | None = None  # the module whose call starts the layers
    in_first: int = 0  # calls of it under way
    leaked: set[int] = field(default_factory=set)  # candidates whose results are read past the first layer's input

    def read(self, param_id: int) -> set[int]:
        """The candidates that read the parameter ``param_id`` now: the called one holding it, or every holder."""
        holders = self.holders.get(param_id, [])
        own = [c for c in self.active if c in holders]
        reading = set(own[:1] or holders)
        for c in reading:
            self.used.setdefault(c, set()).add(self.phase)
        return reading


class _Reads(TorchFunctionMode):
    """Records, per torch function call, the candidates' parameters it reads and the results derived from them."""

    def __init__(self, record: _Record) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        record = self.record
        sources: set[int] = set()
        for t in tensors_in((args, kwargs)):
            sources |= record.read(id(t))
            derived = record.derived.get(id(t))
            if derived is None:
                continue
            if record.phase == "before":
                sources |= derived[1]
            elif func not in _STRUCTURE and not (id(t) in record.crossing and record.in_first):
                record.leaked |= derived[1]
        out = func(*args, **kwargs)
        if record.phase == "before" and sources:
            for t in tensors_in(out):
                record.derived[id(t)] = (t, frozenset(sources))
        return out


@contextmanager
def _hooks(record: _Record, candidates: list[nn.Module], container: nn.Sequential | nn.ModuleList) -> Iterator[None]:
    """The calls of the candidates and of the split layers, seen by ``record``."""
    handles = []
    for index, candidate in enumerate(candidates):

        def enter(_: nn.Module, args: tuple, index: int = index) -> None:
            record.active.append(index)
            record.used.setdefault(index, set()).add(record.phase)

        def leave(_: nn.Module, args: tuple, output: Any) -> None:
            record.active.pop()

        handles += [candidate.register_forward_pre_hook(enter), candidate.register_forward_hook(leave)]

    layers = list(container)
    ends_at = {id(container), id(layers[-1])}  # a Sequential called whole, or a loop's last layer

    def start(module: nn.Module, args: tuple, kwargs: dict) -> None:
        record.first = module if record.first is None else record.first
        if record.phase == "before":
            hidden = args[0] if args else next(iter(kwargs.values()), None)
            record.crossing = {id(t) for t in tensors_in(hidden)}
        record.phase = "during"
        if module is record.first:
            record.in_first += 1

    def finish(module: nn.Module, args: tuple, output: Any) -> None:
        if module is record.first:
            record.in_first -= 1
        if id(module) in ends_at:
            record.phase = "after"

    for m in dict.fromkeys([container, layers[0], layers[-1]]):  # a ModuleList is never called itself
        handles += [m.register_forward_pre_hook(start, with_kwargs=True), m.register_forward_hook(finish)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def trace_ends(module: nn.Module, container: nn.Sequential | nn.ModuleList, run: Callable[[], Any]) -> TracedEnds:
    """Run ``run`` (one micro-batch of the model's step) and classify the candidates of :func:`end_candidates`; a
    step that fails or never runs the layers finds nothing (every module stays on every stage)."""
    named = end_candidates(module, container)
    if not named or len(container) == 0:
        return TracedEnds()
    holders: dict[int, list[int]] = {}
    for index, (_, candidate) in enumerate(named):
        for p in candidate.parameters():
            holders.setdefault(id(p), []).append(index)
    record = _Record(holders)
    try:
        with _hooks(record, [m for _, m in named], container), _Reads(record):
            run()
    except Exception as error:  # the user's step outside the Trainer's loop: nothing is moved
        return TracedEnds(failed=f"the traced step failed: {type(error).__name__}: {error}")
    if record.first is None:
        return TracedEnds(failed="the traced step never ran the split layers")
    first, last, kept = [], [], []
    for index, (path, _) in enumerate(named):
        phases = record.used.get(index, set())
        if phases == {"before"} and index not in record.leaked:
            first.append(path)
        elif phases == {"after"}:
            last.append(path)
        else:
            kept.append((path, _reason(phases, index in record.leaked)))
    return TracedEnds(tuple(first), tuple(last), tuple(kept))


def _reason(phases: set[Phase], leaked: bool) -> str:
    if not phases:
        return "not used in the traced step"
    if "during" in phases:
        return "used while the split layers run"
    if leaked:
        return "its result is read past the first layer's input"
    return "used both before and after the split layers"
