"""Skip connections in a split ``nn.Sequential`` (U-Net, DenseNet style), declared as torchgpipe does
(users import the names from :mod:`lightning_pipe.skips`).

A layer that keeps a tensor for a later layer *stashes* it under a name, and the later layer *pops*
it; each declares the names with :func:`skippable`, so that the split knows at setup which stage
stashes and which pops each name::

    @skippable(stash=["down1"])
    class Down(nn.Module):
        def forward(self, x):
            y = self.conv(x)
            stash("down1", y)
            return self.pool(y)

    @skippable(pop=["down1"])
    class Up(nn.Module):
        def forward(self, x):
            return self.conv(torch.cat([self.up(x), pop("down1")], dim=1))

Without the pipeline (one process, or the model outside the Trainer) a stash is kept until its pop,
so the same model trains as a plain ``nn.Sequential``. Under the pipeline a stashed tensor whose pop
is on a later stage goes from the stashing stage straight to the popping one, and its gradient
straight back (:func:`skip_routes` decides the pairs at setup; the executor sends them beside the
schedule's own messages, or hands them over in memory where one process holds both stages): the
stages between never see it. Unlike torchgpipe's ``yield stash(...)``, the layer calls :func:`stash` and
:func:`pop` as plain functions; its ``forward`` is not a generator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from itertools import accumulate
from typing import TypeVar

from torch import Tensor, nn

from lightning_pipe.torch_internals import forward_hooks

M = TypeVar("M", bound=type[nn.Module])

#: the stashed tensors of the stage (or the plain forward) running now, by name
_scope: ContextVar[dict[str, Tensor] | None] = ContextVar("lightning_pipe_skips", default=None)
#: where stashes go when no stage runs (plain training, the model outside the Trainer)
_plain: dict[str, Tensor] = {}


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[M], M]:
    """Class decorator: the module's ``forward`` stashes the names ``stash`` and pops ``pop``."""

    def mark(cls: M) -> M:
        cls.stashes = tuple(stash)  # type: ignore[attr-defined]
        cls.pops = tuple(pop)  # type: ignore[attr-defined]
        return cls

    return mark


def stash(name: str, tensor: Tensor) -> None:
    """Keep ``tensor`` for the later layer that pops ``name``."""
    scope = _current()
    if name in scope:
        raise RuntimeError(f"A layer stashed {name!r} again before a later layer popped it; stash each name once.")
    scope[name] = tensor


def pop(name: str) -> Tensor:
    """The tensor an earlier layer stashed under ``name``."""
    scope = _current()
    if name not in scope:
        raise RuntimeError(
            f"A layer popped {name!r}, which no earlier layer stashed in this forward. Stash it in an earlier layer "
            "of the Sequential, and declare it there with @skippable(stash=[...]) and here with @skippable(pop=[...])."
        )
    return scope.pop(name)


def active_scope() -> dict[str, Tensor] | None:
    """The scope of the stage whose layers run now, or None (plain training, a stage without skips)."""
    return _scope.get()


def _current() -> dict[str, Tensor]:
    scope = _scope.get()
    return _plain if scope is None else scope


@contextmanager
def skip_scope(received: dict[str, Tensor]) -> Iterator[dict[str, Tensor]]:
    """While a stage's layers run: their stashes and pops go to a scope of their own, which starts
    with the tensors ``received`` from earlier stages; after, it holds what leaves the stage."""
    scope = dict(received)
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)


def recorded_names(layer: nn.Module) -> tuple[str, ...]:
    """The names the recording hooks (:mod:`lightning_pipe.runtime.crossing.records`) on ``layer`` and its
    submodules record: stashed there, popped after the Sequential's last layer for the step to read."""
    return tuple(h.recorded_name for m in layer.modules() for h in forward_hooks(m) if hasattr(h, "recorded_name"))


def declared(layer: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names ``layer`` (or a module inside it) stashes and pops, as :func:`skippable` declared them."""
    stashes = tuple(n for m in layer.modules() for n in getattr(m, "stashes", ()))
    pops = tuple(n for m in layer.modules() for n in getattr(m, "pops", ()))
    return (*stashes, *recorded_names(layer)), pops  # a recording hook's value: popped after the last layer


#: per pair of split stages (the stage that stashes, the later stage that pops), the names stashed on
#: the first and popped on the second, sorted; only pairs of two stages
Routes = dict[tuple[int, int], tuple[str, ...]]


def skip_routes(layers: Sequence[nn.Module], balance: Sequence[int]) -> Routes:
    """Which names go from which stage straight to which later stage (:data:`Routes`): stashed on
    one, popped on the other; the stages between never see them. Raises where the declarations do
    not pair up (a pop before its stash, a name stashed twice or never popped)."""
    ends = list(accumulate(balance))
    stage_of = [next(s for s, end in enumerate(ends) if i < end) for i in range(len(layers))]
    stashed: dict[str, int] = {}
    popped: dict[str, int] = {}
    for index, layer in enumerate(layers):
        stashes, pops = declared(layer)
        for name in pops:
            if name not in stashed or name in popped:
                raise ValueError(
                    f"Layer {index} declares @skippable(pop=[{name!r}]), but no earlier layer declares "
                    f"stash=[{name!r}] (or another layer popped it already). Declare the stash on the layer that "
                    "stashes it, before the layer that pops it, and pop each name once."
                )
            popped[name] = index
        for name in stashes:
            if name in stashed:
                raise ValueError(f"Layers {stashed[name]} and {index} both declare stash=[{name!r}]; use two names.")
            stashed[name] = index
    for name in {n for layer in layers for n in recorded_names(layer)}:  # read by the step, after the last layer
        popped[name] = len(layers) - 1
    unpopped = sorted(set(stashed) - set(popped))
    if unpopped:
        raise ValueError(
            f"Layers stash {unpopped} but no later layer declares @skippable(pop=[...]) for them; pop each stashed "
            "name in a later layer of the Sequential."
        )
    routes: Routes = {}
    for name in sorted(stashed):
        pair = (stage_of[stashed[name]], stage_of[popped[name]])
        if pair[0] != pair[1]:
            routes[pair] = (*routes.get(pair, ()), name)
    return dict(sorted(routes.items()))


def skips_into(routes: Routes, stage: int) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """What ``stage`` receives: per earlier stage that stashes for it (in stage order), the names."""
    return tuple((source, names) for (source, target), names in routes.items() if target == stage)


def skips_from(routes: Routes, stage: int) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """What ``stage`` sends: per later stage that pops what it stashed (in stage order), the names."""
    return tuple((target, names) for (source, target), names in routes.items() if source == stage)


def take_skips(scope: dict[str, Tensor], leaving: Sequence[str], stage: int) -> list[Tensor]:
    """The tensors of ``leaving`` from a stage's scope after its layers ran; raises where a layer
    stashed a name it did not declare (it would be lost) or a declared stash did not happen."""
    missing = [n for n in leaving if n not in scope]
    if missing:
        raise RuntimeError(
            f"Stage {stage}'s layers declare @skippable(stash={missing}) but did not stash them in this forward; a "
            "declared stash must happen in every forward."
        )
    extra = sorted(set(scope) - set(leaving))
    if extra:
        raise RuntimeError(
            f"Stage {stage}'s layers stashed {extra} without declaring them (or a later stage pops them without "
            "declaring it): declare every stash and pop with @skippable(stash=[...], pop=[...]), so that the "
            "pipeline sends them to the stage that pops them."
        )
    return [scope[n] for n in leaving]


def routes_line(routes: Routes, positions: Sequence[int], mirrored: bool = False) -> str:
    """What the layout line adds for skip connections that cross stages (empty when none do): per
    pair of stages the names sent from the one to the other, and where both are on one process
    (``positions[s]``: the process of split stage ``s``), that they stay in its memory; ``mirrored``:
    Chimera's up pipeline sends the same between the two stages' copies."""
    parts = [
        f"{s} -> {t}: {', '.join(names)}{f' (in process {positions[s]})' if positions[s] == positions[t] else ''}"
        for (s, t), names in routes.items()
    ]
    if not parts:
        return ""
    copies = " (and between the same stages' copies in the up pipeline)" if mirrored else ""
    return f"; skip connections sent from the stashing stage to the popping stage {'; '.join(parts)}{copies}"
