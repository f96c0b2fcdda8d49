"""Find the ``nn.Sequential`` to split and carve out one stage of it under the original names."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence, Union

from torch import nn

from lightning_pipe.partition.balance import balance_by_cost, balance_uniform, check_balance, stage_bounds

BalanceSpec = Union[str, Sequence[int]]
BALANCE_MODES = ("uniform", "parameters", "time", "memory")


def find_sequential(module: nn.Module, name: str | None = None) -> tuple[str, nn.Sequential]:
    """The attribute of ``module`` that holds the layers to split.

    With ``name`` the attribute must be an ``nn.Sequential``; without it the module must have
    exactly one top-level ``nn.Sequential``.
    """
    cls = type(module).__name__
    if name is not None:
        found = getattr(module, name, None)
        if found is None:
            children = ", ".join(n for n, _ in module.named_children()) or "none"
            raise ValueError(f"PipelineStrategy(module={name!r}): {cls} has no attribute {name!r}. Its submodules: {children}.")
        if not isinstance(found, nn.Sequential):
            raise TypeError(
                f"PipelineStrategy(module={name!r}): {cls}.{name} is a {type(found).__name__}, not an nn.Sequential. "
                f"Express the layers to split as an nn.Sequential."
            )
        return name, found
    candidates = [(n, m) for n, m in module.named_children() if isinstance(m, nn.Sequential)]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise ValueError(
            f"{cls} has no top-level nn.Sequential to split into pipeline stages. Put the layers to split in an "
            f"nn.Sequential attribute (for example self.layers = nn.Sequential(...)) and call it from forward."
        )
    names = ", ".join(repr(n) for n, _ in candidates)
    raise ValueError(
        f"{cls} has several top-level nn.Sequential attributes ({names}); choose one with "
        f"PipelineStrategy(module=...)."
    )


def parameter_costs(layers: nn.Sequential) -> list[float]:
    """Parameter count per layer, the cost behind ``balance="parameters"``."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]


def resolve_balance(balance: BalanceSpec, layers: nn.Sequential, num_stages: int) -> list[int]:
    """Turn the user's ``balance`` into layer counts per stage."""
    num_layers = len(layers)
    if isinstance(balance, str):
        if balance == "uniform":
            return balance_uniform(num_layers, num_stages)
        if balance == "parameters":
            return balance_by_cost(parameter_costs(layers), num_stages)
        if balance in ("time", "memory"):
            raise ValueError(
                f"balance={balance!r} needs a measured profile (lightning_pipe.partition.profile); "
                "PipelineStrategy measures one itself."
            )
        raise ValueError(f"Unknown balance {balance!r}. Valid: {', '.join(BALANCE_MODES)}, or a list of layer counts per stage.")
    if num_layers < num_stages:
        balance_uniform(num_layers, num_stages)  # raises the "more stages than layers" error
    return check_balance(balance, num_layers, num_stages)


def stage_layers(layers: nn.Sequential, balance: Sequence[int], stage: int) -> "OrderedDict[str, nn.Module]":
    """The layers of ``stage`` keyed by their names in the unsplit Sequential (``"7"``, ...), so
    parameter names (``layers.7.weight``) survive the split."""
    start, stop = stage_bounds(balance)[stage]
    named = list(layers.named_children())
    return OrderedDict(named[start:stop])


def tied_parameters(layers: nn.Sequential, balance: Sequence[int]) -> list[dict[int, str]]:
    """Parameters shared by layers of different stages (one tensor used in two places, like word
    embeddings tied to a language-model head), each as ``{stage: its name inside that stage}``,
    in a fixed order. Each stage keeps its own copy; their gradients must be summed."""
    bounds = stage_bounds(balance)
    owners: dict[int, dict[int, str]] = {}
    for index, (key, layer) in enumerate(layers.named_children()):
        stage = next(s for s, (a, b) in enumerate(bounds) if a <= index < b)
        for name, param in layer.named_parameters(remove_duplicate=False):
            owners.setdefault(id(param), {}).setdefault(stage, f"{key}.{name}")
    return [where for where in owners.values() if len(where) > 1]
