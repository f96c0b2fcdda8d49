"""Initialise the modules of a Hugging Face ``PreTrainedModel`` as Hugging Face does, one module at
a time, so that a model built on the meta device starts from HF's rules rather than PyTorch's.

Hugging Face models are not initialised by their modules' ``reset_parameters()``: a
``PreTrainedModel`` builds its modules with PyTorch's defaults and then, in ``post_init()``,
walks them children before parents calling its own ``_init_weights(module)`` on each (composite
models hand each sub-model's modules to that sub-model's ``_init_weights``). The rules are the
model's: ``normal(0, initializer_range)`` for ``Linear``/``Embedding`` weights, ones and zeros
for norms, GPT-2's residual projections scaled by ``1/sqrt(2 * n_layer)``, rotary frequencies
recomputed from the config. Built on the meta device, ``post_init`` skips all of it, so a
meta-built model must be initialised afterwards, module by module, the same way.

This module finds, for each module, the nearest enclosing ``PreTrainedModel`` and calls its
``_init_weights`` as ``PreTrainedModel.initialize_weights`` does: without gradients and under
``transformers.initialization.guard_torch_init_functions()`` (so a tensor HF marked as loaded
keeps its value). It calls ``_init_weights`` rather than ``_initialize_weights``: the latter skips
modules flagged ``_is_hf_initialized``, and a module re-initialised here must be initialised
whatever it was flagged. Nothing here imports ``transformers`` unless the user's model already
did.
"""

from __future__ import annotations

import contextlib
import sys
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from lightning_pipe.torch_internals import hf_init_weights


def _pretrained_class() -> type | None:
    """``transformers.PreTrainedModel`` when ``transformers`` is loaded (a model of it can only
    exist then), else None."""
    loaded = sys.modules.get("transformers.modeling_utils")
    return getattr(loaded, "PreTrainedModel", None) if loaded is not None else None


def is_pretrained_model(module: nn.Module) -> bool:
    cls = _pretrained_class()
    return cls is not None and isinstance(module, cls)


def pretrained_owners(root: nn.Module) -> dict[int, nn.Module]:
    """``id(module)`` -> the nearest enclosing ``PreTrainedModel`` (the module itself when it is
    one), for every module of ``root`` inside one. A module reachable from several places belongs
    to the deepest model that holds it, as in HF's own walk."""
    if _pretrained_class() is None:
        return {}
    owners: dict[int, nn.Module] = {}

    def walk(module: nn.Module, owner: nn.Module | None, seen: set[int]) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        owner = module if is_pretrained_model(module) else owner
        if owner is not None:
            owners[id(module)] = owner
        for child in module.children():
            walk(child, owner, seen)

    # models first, deepest last, so a module held by a sub-model is claimed by it
    models = sorted((m for m in root.modules() if is_pretrained_model(m)), key=lambda m: _depth(root, m))
    for model in models:
        walk(model, None, set())
    return owners


def _depth(root: nn.Module, target: nn.Module) -> int:
    for name, m in root.named_modules():
        if m is target:
            return name.count(".") + (1 if name else 0)
    return 0


def hf_init_context() -> AbstractContextManager[Any]:
    """What ``PreTrainedModel.initialize_weights`` runs its walk under (older ``transformers``
    without ``transformers.initialization``: nothing)."""
    guard = getattr(sys.modules.get("transformers.initialization"), "guard_torch_init_functions", None)
    if guard is None:
        try:
            from transformers.initialization import guard_torch_init_functions
        except ImportError:
            return contextlib.nullcontext()
        guard = guard_torch_init_functions
    return guard()


def init_with_owner(owner: nn.Module, module: nn.Module) -> None:
    """Initialise ``module``'s tensors by ``owner._init_weights`` (``owner`` its enclosing
    ``PreTrainedModel``); call under :func:`hf_init_context` and ``torch.no_grad()``."""
    hf_init_weights(owner, module)
