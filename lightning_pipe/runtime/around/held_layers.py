"""The split ``nn.Sequential`` as the module's own code sees it: the unsplit module's indices on every rank.

On each rank the Sequential is replaced by a :class:`~lightning_pipe.runtime.stage.StageModule` holding
only its stage's layers, under their original names. Code around the pipelined call (parameter groups
built by position in ``configure_optimizers``, ``enumerate(self.layers)``, ``self.layers[:4]``, a read of
``self.layers[0].out_features``) must see the unsplit module's positions, so each position answers:

- a layer this rank holds: the layer itself;
- a layer another stage holds: a :class:`HeldLayer`, a module with the layer's plain attributes and its
  submodules' structure but no parameters or buffers (so parameter groups built from it are empty here,
  and every rank's parameters land in the groups plain training gives them); reading one of its tensors
  or calling it raises :class:`HeldLayerError`, naming the stage that holds it.

While the user's step runs, a loop over the Sequential (``for layer in self.layers: x = layer(x)``) goes
through :class:`SequentialLoop`: the stage's first layer runs the stage's part of the micro-batch (the
same work as calling the Sequential), the layers before it hand their input on as a value no code may
read (:func:`~lightning_pipe.runtime.blocks.reads.held`), those after it hand the stage's output on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lightning_pipe.runtime.blocks.container import plain_attributes
from lightning_pipe.runtime.blocks.reads import held
from lightning_pipe.runtime.crossing.records import Recording
from lightning_pipe.torch_internals import forward_hooks


class HeldLayerError(RuntimeError):
    """Code needed the tensors of a layer of the split Sequential that another pipeline stage holds."""


def _holder(stage: int, num_stages: int) -> str:
    return f"pipeline stage {stage} of {num_stages}"


class HeldLayer(nn.Module):
    """A layer (or a submodule of one: ``path``) of the split Sequential or block container, held by
    ``stage``: its plain attributes and submodules (as stand-ins), without tensors. ``place``: how
    messages name the layer (``"layer 4 of the pipelined Sequential"``)."""

    def __init__(self, layer: nn.Module, place: str, path: str, stage: int, num_stages: int) -> None:
        super().__init__()
        for key, value in plain_attributes(layer).items():
            if not isinstance(value, (Tensor, nn.Module)):
                self.__dict__[key] = value
        self.training = layer.training
        tensors = [n for n, _ in layer.named_parameters(recurse=False)] + [
            n for n, _ in layer.named_buffers(recurse=False)
        ]
        self.__dict__["_held"] = (type(layer).__name__, place, path, stage, num_stages, frozenset(tensors))
        #: the names of the user's forward hooks on the layer (which run on the stage that holds it)
        self.__dict__["hooks"] = tuple(
            getattr(h, "__qualname__", type(h).__name__) for h in forward_hooks(layer) if not isinstance(h, Recording)
        )  # a recording hook's value crosses to the last stage (lightning_pipe.recording)
        for name, child in layer.named_children():
            self.add_module(name, HeldLayer(child, place, f"{path}.{name}", stage, num_stages))

    def hooked(self) -> list[str]:
        """Every forward hook on the layer and its submodules, and where it runs."""
        return [f"{h} on {m.where()}" for m in self.modules() if isinstance(m, HeldLayer) for h in m.hooks]

    def where(self) -> str:
        kind, place, path, stage, num_stages, _ = self.__dict__["_held"]
        return f"{path} ({kind}, {place}) is held by {_holder(stage, num_stages)}"

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in self.__dict__["_held"][5]:
                raise HeldLayerError(
                    f"{self.where()}: its {name!r} is not on this rank. Code around the pipelined call may read "
                    "other stages' layers for their structure and plain attributes only. Compute what needs their "
                    "tensors inside the layers, or see 'What code around the pipelined call may read' in the docs."
                ) from None
            raise

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise HeldLayerError(self._unhookable())

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise HeldLayerError(self._unhookable())

    def _unhookable(self) -> str:
        return (
            f"{self.where()}: a hook registered here would never run (the layer runs on that stage). Register hooks "
            "in the module's __init__, before the split: lightning_pipe.recording(name) for a value the step reads."
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise HeldLayerError(
            f"{self.where()}; it runs inside the Trainer's steps. To use the whole model outside the Trainer, "
            "load a consolidated checkpoint."
        )

    def extra_repr(self) -> str:
        kind, _, _, stage, num_stages, _ = self.__dict__["_held"]
        return f"{kind}, held by {_holder(stage, num_stages)}"


def held_layers(layers: nn.Module, bounds: list[tuple[int, int]], path: str) -> list[HeldLayer]:
    """A :class:`HeldLayer` for every position of ``layers`` (an ``nn.Sequential`` or a block container)
    split at ``bounds`` (``[start, stop)`` per stage); ``path``: how messages name its layers (``"layers"``)."""
    stage_of = [s for s, (a, b) in enumerate(bounds) for _ in range(a, b)]
    noun = (
        "layer {} of the pipelined Sequential"
        if isinstance(layers, nn.Sequential)
        else "block {} of the pipelined container"
    )
    return [
        HeldLayer(layer, noun.format(i), f"{path}.{key}" if path else key, stage_of[i], len(bounds))
        for i, (key, layer) in enumerate(layers.named_children())
    ]


class SequentialLoop:
    """One micro-batch's loop over the split Sequential in the user's step, on one stage: positions
    ``start`` to ``stop`` (exclusive) are the stage's; ``run`` is the stage's part of the micro-batch
    (what calling the Sequential does), called at the first of them."""

    def __init__(self, start: int, stop: int, length: int, run: Callable[[Any], Any]) -> None:
        self.start, self.stop, self.length = start, stop, length
        self.run = run
        self.called = -1  # the last position called
        self.value: Any = None  # what the last position called returned

    def call(self, index: int, value: Any) -> Any:
        if index != self.called + 1:
            raise RuntimeError(
                f"The step called layer {index} of the pipelined Sequential after layer {self.called}. Under the "
                "pipeline a loop over the Sequential must call every layer once, in order, from layer 0."
            )
        if index > 0 and value is not self.value:
            raise RuntimeError(
                f"The step changed the value between layers {index - 1} and {index} of the pipelined Sequential. Under "
                "the pipeline a loop over the Sequential must give each layer the previous layer's output unchanged "
                "(the stages run the Sequential's chain); compute anything else inside a layer."
            )
        self.called = index
        if index < self.start:
            self.value = held(value, index, (self.start, self.stop))
        elif index == self.start:
            self.value = self.run(value)
        return self.value

    def check(self) -> None:
        """After the step: a loop that started ran to the Sequential's end (the stage ran all its layers)."""
        if self.called >= self.start and self.called != self.length - 1:
            raise RuntimeError(
                f"The step's loop over the pipelined Sequential stopped after layer {self.called} of "
                f"{self.length}. Under the pipeline a loop over the Sequential must run all its layers; loop over a "
                "shorter Sequential instead."
            )


class LoopEntry:
    """What the step's loop gets at one position: calls go through the loop, attributes to the layer
    (or its :class:`HeldLayer`)."""

    def __init__(self, loop: SequentialLoop, index: int, layer: nn.Module) -> None:
        self._loop = loop
        self._index = index
        self._layer = layer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)

    def __call__(self, value: Any) -> Any:
        return self._loop.call(self._index, value)


def refuse_hooks_elsewhere(stand_ins: list[HeldLayer], stage: int) -> None:
    """Raise where a layer before ``stage``'s, held by another stage, has a forward hook: it runs on that
    stage, and what it records there never reaches the step's loss on this one (intermediate supervision,
    feature matching would silently train on another loss)."""
    hooked = [line for layer in stand_ins for line in layer.hooked()]
    if not hooked:
        return
    raise HeldLayerError(
        f"A forward hook is registered on a layer of the pipelined Sequential that another stage holds "
        f"({'; '.join(hooked[:3])}), while the step's loss runs on pipeline stage {stage}: "
        "the hook runs on the stage that holds its layer, so what it records there never reaches the loss here "
        "(the loss would read None or an old value). Register lightning_pipe.recording(name) as the hook and read "
        "lightning_pipe.recorded(name) in the step: the value then travels to the last stage with the micro-batch "
        "(the same in plain training); remove hooks that only observe. Refused before any weight changed."
    )
