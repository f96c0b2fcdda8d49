"""The user's optimizers, made over the whole model before ``fabric.setup`` split it, narrowed to the
parameters this rank keeps.

A Fabric loop makes its optimizer from ``model.parameters()`` before setting the model up; after the
split this rank holds only its stages, and a meta-built module's stages are new tensors. Each group
keeps the parameters this rank holds, found by identity or by their name in the unsplit module.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.optim import Optimizer


def names_by_identity(module: nn.Module) -> dict[int, str]:
    """Every parameter's name in ``module`` (its first, for a tied one), by identity: taken before the split."""
    return {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}


def keep_held_parameters(optimizer: Optimizer, module: nn.Module, names: Mapping[int, str]) -> None:
    """Narrow ``optimizer``'s groups to the parameters ``module`` holds now, in the groups' order; ``names``:
    :func:`names_by_identity` of the module before the split. A group left without parameters stays, empty,
    so that group indices (a scheduler's, a checkpoint's) keep their meaning."""
    held = dict(module.named_parameters(remove_duplicate=False))
    by_identity = {id(p): p for p in held.values()}
    for group in optimizer.param_groups:
        kept: list[nn.Parameter] = []
        for p in group["params"]:
            found = by_identity.get(id(p))
            if found is None:
                found = held.get(names.get(id(p), ""))
            if found is not None and all(found is not q for q in kept):
                kept.append(found)
        group["params"] = kept
    stale = [p for p in optimizer.state if id(p) not in by_identity]
    if stale:
        raise ValueError(
            f"The optimizer holds state for {len(stale)} parameters made before fabric.setup split the model "
            "(it has stepped already). Make the optimizer before its first step, or set the model up first "
            "(model = fabric.setup_module(model); optimizer = fabric.setup_optimizers(make(model.parameters())))."
        )
