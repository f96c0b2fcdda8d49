"""The ends of a block-container model: its input embeddings belong to the first stage, its output
embeddings (the language-model head) to the last.

Outside the split layers a model's modules run on every stage (see
:mod:`lightning_pipe.runtime.blocks.container`), which is right for the small ones (rotary tables, final
norms, masks) but not for the embeddings: a vocabulary of 128k tokens makes them the largest
tensors of the model. A Hugging Face ``PreTrainedModel`` names them itself
(``get_input_embeddings()``, ``get_output_embeddings()``), so for a block container inside one:

- the input embeddings are held by the first stage only; every other stage gets a
  :class:`StandIn`, which returns zeros of the output's shape and dtype (computed on the meta
  device), since there the embedding only produces the hidden state that the stage's first block
  replaces by what it receives, and the shape and dtype that masks and rotary tables are built from;
- the output embeddings are held by the last stage only (no other stage runs past its blocks);
- an embedding tied to the head is a weight tied across the first and last stage, its gradients
  summed as for any tie.

A model of the user's own names nothing: its ends are the modules one traced step finds used only before or only
after the split layers (:mod:`lightning_pipe.partition.stages.end_trace`), or those ``first_stage=`` and
``last_stage=`` name (:func:`model_ends`), for an ``nn.Sequential`` as for an ``nn.ModuleList``.

For materialising and initialising, the ends are extra layers after the blocks
(:func:`extended`), so they follow the per-layer rule of :mod:`lightning_pipe.partition.stages.materialize`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.partition.stages.end_trace import TracedEnds, end_candidates
from lightning_pipe.partition.stages.hf_init import is_pretrained_model
from lightning_pipe.torch_internals import module_slots


@dataclass
class Ends:
    """The modules of a block-container model held by one end stage each: ``pre`` by the first,
    ``post`` by the last, each with its path in the user's module."""

    pre: list[tuple[str, nn.Module]] = field(default_factory=list)
    post: list[tuple[str, nn.Module]] = field(default_factory=list)

    @property
    def modules(self) -> list[nn.Module]:
        return [m for _, m in self.pre + self.post]


def find_ends(module: nn.Module, container: nn.Module) -> Ends:
    """The input and output embeddings of the Hugging Face model around ``container`` (an
    ``nn.ModuleList`` of blocks); none for other models and for an ``nn.Sequential``, whose layers
    hold their own ends.

    The input embeddings are those of the innermost model around the blocks: an encoder-decoder
    names the decoder's as its own, which run after the encoder's blocks, on the last stage. An end
    whose weight another module outside the blocks also holds (BART's encoder, decoder and head
    share one embedding; Whisper's decoder embedding is tied to its head) is no end: the stages that
    run that module need the weight, so every stage keeps it, as any parameter outside the blocks."""
    if not isinstance(container, nn.ModuleList):
        return Ends()
    paths = {id(m): name for name, m in module.named_modules()}
    models = [m for m in module.modules() if is_pretrained_model(m) and any(c is container for c in m.modules())]
    if not models:
        return Ends()
    inside = {id(m) for m in container.modules()}

    def found(model: nn.Module, getter: str) -> list[tuple[str, nn.Module]]:
        try:
            end = getattr(model, getter)()
        except (AttributeError, NotImplementedError):  # a model without that end (ViT has no output embeddings)
            return []
        if not isinstance(end, nn.Module) or id(end) in inside or id(end) not in paths:
            return []
        return [(paths[id(end)], end)]

    # models: outermost first (a causal LM's head sits beside its base model); the input embeddings
    # from the innermost model that has them
    pre = next((e for e in (found(m, "get_input_embeddings") for m in reversed(models)) if e), [])
    post = found(models[0], "get_output_embeddings")
    if pre and post and pre[0][1] is post[0][1]:
        post = []
    shared = shared_elsewhere(module, container, pre + post)
    keep = lambda pairs: [(p, m) for p, m in pairs if not any(id(t) in shared for t in m.parameters())]  # noqa: E731
    return Ends(keep(pre), keep(post))


def model_ends(
    module: nn.Module,
    container: nn.Module,
    first_stage: Sequence[str] | None = None,
    last_stage: Sequence[str] | None = None,
    traced: TracedEnds | None = None,
) -> Ends:
    """The ends of the split of ``container``: for each end, the modules named by hand (``first_stage``,
    ``last_stage``), else those one traced step found (:mod:`lightning_pipe.partition.stages.end_trace`), else a
    Hugging Face model's embeddings (:func:`find_ends`). A traced end whose weight a module on every stage also
    holds stays there too; a named one is refused."""
    found = find_ends(module, container)

    def side(names: Sequence[str] | None, argument: str, traced_paths: tuple[str, ...] | None, hf: list) -> list:
        if names is not None:
            return [(path, _named_end(module, container, argument, path)) for path in names]
        if traced_paths is not None:
            return [(path, module.get_submodule(path)) for path in traced_paths]
        return hf

    pre = side(first_stage, "first_stage", traced.first if traced is not None else None, found.pre)
    post = side(last_stage, "last_stage", traced.last if traced is not None else None, found.post)
    shared = shared_elsewhere(module, container, pre + post)
    named = {path for path in (*(first_stage or ()), *(last_stage or ()))}
    for path, end in pre + post:
        if path in named and any(id(t) in shared for t in end.parameters()):
            raise ValueError(
                f"PipelineStrategy(first_stage=..., last_stage=...) names {path!r}, whose weight a module outside "
                "the split layers and the named end modules also holds (a tie), so every stage needs it. Name that "
                "module at the same end too (or at the other end, a weight tied across the end stages), or leave "
                f"{path!r} out."
            )
    keep = lambda pairs: [(p, m) for p, m in pairs if not any(id(t) in shared for t in m.parameters())]  # noqa: E731
    return Ends(keep(pre), keep(post))


def _named_end(module: nn.Module, container: nn.Module, argument: str, path: str) -> nn.Module:
    """The module at ``path`` in ``module``, refused where it is no module beside the split layers."""
    candidates = ", ".join(repr(p) for p, _ in end_candidates(module, container)) or "none"
    try:
        end = module.get_submodule(path)
    except AttributeError:
        end = None
    inside = {id(m) for m in container.modules()}
    around = {id(m) for m in module.modules() if any(c is container for c in m.modules())}
    if end is None or id(end) in inside or id(end) in around:
        what = "is no submodule" if end is None else "holds the split layers or is one of them"
        raise ValueError(
            f"PipelineStrategy({argument}=[..., {path!r}, ...]): {path!r} {what} of {type(module).__name__}. Name "
            f"modules beside the split layers; those holding parameters: {candidates}."
        )
    return end


def shared_elsewhere(module: nn.Module, container: nn.Module, ends: list[tuple[str, nn.Module]]) -> set[int]:
    """The ids of the ends' parameters that a module outside ``container`` and the ends also holds
    directly, other than a module around an end (BERT's head holds its decoder's bias, and runs only
    where the decoder does)."""
    own = {id(t) for _, end in ends for t in end.parameters()}
    skip = {id(m) for m in container.modules()} | {id(m) for _, end in ends for m in end.modules()}
    around = {id(m) for m in module.modules() if any(c is end for _, end in ends for c in m.modules())}
    shared: set[int] = set()
    for holder in module.modules():
        if id(holder) in skip or id(holder) in around:
            continue
        shared |= {id(t) for _, t in holder.named_parameters(recurse=False, remove_duplicate=False)} & own
    return shared


def extended(layers: nn.Sequential | nn.ModuleList, ends: Ends) -> nn.ModuleList:
    """The blocks followed by the input and then the output embeddings, as the list of layers to
    materialise and initialise (the blocks keep their indices)."""
    return nn.ModuleList([*layers, *ends.modules])


def end_parameters(ends: Ends) -> tuple[float, float]:
    """The parameter counts the first and the last stage hold for the ends (a tied weight on both)."""
    count = lambda pairs: float(sum(p.numel() for _, m in pairs for p in m.parameters()))  # noqa: E731
    return count(ends.pre), count(ends.post)


def end_stages(num_layers: int, ends: Ends, num_stages: int) -> list[int]:
    """The stage of each end module of :func:`extended`, after its ``num_layers`` blocks."""
    return [0] * len(ends.pre) + [num_stages - 1] * len(ends.post)


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose tensors are on the meta device (no storage; ``module`` unchanged)."""
    memo: dict[int, Any] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


class StandIn(nn.Module):
    """Where a stage does not hold the input embeddings: zeros of what they would return. The
    stage's first block replaces the hidden state they start anyway; their shape and dtype are what
    the model builds its masks and rotary tables from. Attributes read from it come from a copy on
    the meta device (no storage)."""

    def __init__(self, original: nn.Module, path: str) -> None:
        super().__init__()
        self._twin = [meta_twin(original)]  # a list: not a submodule, so no parameters here
        self._path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), torch.device("cpu"))
        meta_args = [a.to("meta") if isinstance(a, Tensor) else a for a in args]
        meta_kwargs = {k: v.to("meta") if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        out = self._twin[0](*meta_args, **meta_kwargs)
        return _zeros_like(out, device)

    def __getattr__(self, name: str) -> Any:
        """What the model reads of the embeddings (``projection.weight.dtype``, ``embedding_dim``) comes
        from the meta copy: shapes, dtypes and settings without storage."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        try:
            return getattr(self._twin[0], name)
        except AttributeError:
            raise AttributeError(
                f"{self._path} (run before the split layers) is held by the first pipeline stage only; other stages "
                f"run it for the shape of its output. It has no attribute {name!r}."
            ) from None


def _zeros_like(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return torch.zeros(value.shape, dtype=value.dtype, device=device)
    if isinstance(value, (tuple, list)):
        return type(value)(_zeros_like(v, device) for v in value)
    return value


def stand_in_ends(module: nn.Module, ends: Ends, first: bool) -> None:
    """On a stage that is not the first, put a :class:`StandIn` wherever ``module`` holds one of the
    input embeddings (the output embeddings of other stages go with
    :func:`lightning_pipe.partition.stages.split.release_elsewhere`)."""
    if first:
        return
    for path, end in ends.pre:
        stand_in = StandIn(end, path)
        for parent in list(module.modules()):
            for key, child in module_slots(parent):
                if child is end:
                    setattr(parent, key, stand_in)


def held_end_parameters(ends: Ends, stages: Sequence[int], num_stages: int) -> list[nn.Parameter]:
    """The parameters of the end modules that the stages ``stages`` hold."""
    held: list[nn.Module] = []
    if 0 in stages:
        held += [m for _, m in ends.pre]
    if num_stages - 1 in stages:
        held += [m for _, m in ends.post]
    return [p for m in held for p in m.parameters()]


def local_end_indices(num_layers: int, ends: Ends, stages: Sequence[int], num_stages: int) -> list[int]:
    """The indices in :func:`extended` of the end modules held by ``stages``."""
    out = []
    for j, stage in enumerate(end_stages(num_layers, ends, num_stages)):
        if stage in stages:
            out.append(num_layers + j)
    return out


def ends_line(traced: TracedEnds, ends: Ends) -> str:
    """What the setup says of the traced ends, as the split keeps them (a traced end whose weight a module on
    every stage also holds stays there too); nothing where no module beside the split layers holds parameters."""
    if not (traced.first or traced.last or traced.kept or traced.failed):
        return ""
    if traced.failed is not None:
        return (
            f"lightning-pipe: the modules outside the split layers stay on every stage ({traced.failed}); name the end "
            "stages' own with PipelineStrategy(first_stage=[...], last_stage=[...])."
        )
    first, last = [p for p, _ in ends.pre], [p for p, _ in ends.post]
    kept = list(traced.kept) + [(p, "shares a weight with a module on every stage") for p in traced.first + traced.last
                                if p not in first + last]  # fmt: skip
    line = (
        f"lightning-pipe: traced one step: {', '.join(first) or 'nothing'} on the first stage only, "
        f"{', '.join(last) or 'nothing'} on the last stage only"
    )
    if kept:
        line += "; on every stage: " + ", ".join(f"{path} ({why})" for path, why in kept)
    return line + ". PipelineStrategy(first_stage=[...], last_stage=[...]) names them by hand."
