"""Find the layers to split (an ``nn.Sequential``, or a block container) and carve out one stage of
them under the original names."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal, get_args

from torch import nn

from lightning_pipe.partition.solvers.balance import (
    balance_by_cost,
    balance_uniform,
    check_balance,
    owning,
    stage_bounds,
    stages_without_parameters,
)
from lightning_pipe.torch_internals import module_slots

BalanceMode = Literal["uniform", "parameters", "time", "memory"]
BALANCE_MODES: tuple[BalanceMode, ...] = get_args(BalanceMode)
BalanceSpec = BalanceMode | Sequence[int]


Layers = nn.Sequential | nn.ModuleList


def registered_path(module: nn.Module, name: str) -> str:
    """``name`` as the path of registered submodules: a step that is no child of a wrapper exposing the model it
    wraps (``get_base_model()``, as peft's ``PeftModel``) goes through that model, so the model's own path
    (``"model.model.layers"`` for a LoRA-wrapped Llama held as ``self.model``) names the blocks, as the wrapper's
    whole path (``"model.base_model.model.model.layers"``) does."""
    owner, parts = module, []
    for part in name.split("."):
        children = dict(owner.named_children())
        base = getattr(owner, "get_base_model", None)
        if part not in children and callable(base) and isinstance(inner := base(), nn.Module) and inner is not owner:
            prefix = next((n for n, m in owner.named_modules() if m is inner), None)
            if prefix:
                parts.append(prefix)
                owner, children = inner, dict(inner.named_children())
        if part not in children:
            return name  # not a path of submodules: find_sequential says what is there
        parts.append(part)
        owner = children[part]
    return ".".join(parts)


def find_sequential(module: nn.Module, name: str | None = None) -> tuple[str, Layers]:
    """The path in ``module`` of the layers to split, and the container holding them.

    With ``name`` (an attribute, or a dotted path such as ``"model.transformer.h"``) the container
    is an ``nn.Sequential`` that the model calls, or an ``nn.ModuleList`` of blocks that the
    model's ``forward`` loops over (see :mod:`lightning_pipe.runtime.blocks.container`); without it the
    module must have exactly one top-level ``nn.Sequential``.
    """
    cls = type(module).__name__
    if name is not None:
        name = registered_path(module, name)
        try:
            found = module.get_submodule(name)
        except AttributeError:
            parent, _, leaf = name.rpartition(".")
            owner = module
            for part in parent.split(".") if parent else []:
                if not isinstance(getattr(owner, part, None), nn.Module):
                    leaf = part
                    break
                owner = getattr(owner, part)
            children = ", ".join(n for n, _ in owner.named_children()) or "none"
            raise ValueError(
                f"PipelineStrategy(module={name!r}): {type(owner).__name__} has no attribute {leaf!r}. "
                f"Its submodules: {children}."
            ) from None
        if not isinstance(found, (nn.Sequential, nn.ModuleList)):
            raise TypeError(
                f"PipelineStrategy(module={name!r}): {cls}.{name} is a {type(found).__name__}, not an nn.Sequential "
                "or nn.ModuleList. Give the path of the container that holds the model's repeated blocks (for "
                "example 'model.transformer.h' or 'model.model.layers'), or express the layers as an nn.Sequential."
            )
        return name, found
    candidates = [(n, m) for n, m in module.named_children() if isinstance(m, nn.Sequential)]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        containers = block_containers(module)
        example = containers[0][0] if containers else "model.transformer.h"
        listed = ", ".join(f"{path!r} ({what})" for path, what in containers)
        own = f"Its containers of blocks: {listed}. " if containers else ""
        raise ValueError(
            f"{cls} has no top-level nn.Sequential to split into pipeline stages. {own}Name the container of the "
            f"model's repeated blocks with PipelineStrategy(module={example!r}) (an nn.ModuleList or nn.Sequential "
            f"anywhere in the module), or put the layers in an nn.Sequential attribute (self.layers = "
            f"nn.Sequential(...)) and call it from forward."
        )
    names = ", ".join(repr(n) for n, _ in candidates)
    raise ValueError(
        f"{cls} has several top-level nn.Sequential attributes ({names}); choose one with PipelineStrategy(module=...)."
    )


def block_containers(module: nn.Module) -> list[tuple[str, str]]:
    """The ``nn.ModuleList`` and ``nn.Sequential`` attributes anywhere in ``module`` holding at least two modules
    with parameters, outermost only (a block's own lists are not candidates), with their paths and what they hold
    (``"ModuleList of 4 Block"``): what ``PipelineStrategy(module=...)`` can name."""
    found: list[tuple[str, str]] = []
    inside: set[int] = set()
    for path, child in module.named_modules():
        if id(child) in inside or not path or not isinstance(child, (nn.ModuleList, nn.Sequential)):
            continue
        entries = [m for m in child.children() if any(True for _ in m.parameters())]
        if len(entries) < 2:
            continue
        inside |= {id(m) for m in child.modules()}
        kinds = ", ".join(dict.fromkeys(type(m).__name__ for m in entries))
        found.append((path, f"{type(child).__name__} of {len(child)} {kinds}"))
    return found


def place(module: nn.Module, path: str, layers: nn.Module) -> None:
    """Put ``layers`` at ``path`` (dotted) in ``module``, in place of what is there."""
    parent, _, leaf = path.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, leaf, layers)


def parameter_costs(layers: Layers) -> list[float]:
    """Parameter count per layer, the cost behind ``balance="parameters"``."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]


def layer_owners(layers: Layers, end_costs: tuple[float, float] = (0.0, 0.0)) -> list[bool]:
    """Per layer, whether it holds a parameter; the first and the last layer also own the parameters
    of the end stages beyond the layers (``end_costs``, a model's embeddings and head)."""
    owners = [any(True for _ in layer.parameters()) for layer in layers]
    if owners:
        owners[0] = owners[0] or end_costs[0] > 0
        owners[-1] = owners[-1] or end_costs[1] > 0
    return owners


def resolve_balance(
    balance: str | Sequence[int], layers: Layers, num_stages: int, end_costs: tuple[float, float] = (0.0, 0.0)
) -> list[int]:
    """Turn the user's ``balance`` into layer counts per stage (any string: an unknown name is refused here,
    as the command line hands its text in unchecked). ``end_costs``: the parameters the
    first and the last stage hold beyond their layers (a model's embeddings and head, see
    :mod:`lightning_pipe.partition.stages.ends`), counted with the first and the last layer, which those
    stages always hold. ``uniform`` and ``parameters`` give every stage a layer with parameters
    where the layers allow it (a parameter-free layer joins a neighbour's stage), since a stage
    without one would give its optimizer an empty parameter list."""
    num_layers = len(layers)
    owners = layer_owners(layers, end_costs)
    if isinstance(balance, str):
        if balance == "uniform":
            return balance_uniform(num_layers, num_stages, owners)
        if balance == "parameters":
            costs = parameter_costs(layers)
            if costs:
                costs[0] += end_costs[0]
                costs[-1] += end_costs[1]
            return balance_by_cost(costs, num_stages, owners)
        if balance in ("time", "memory"):
            raise ValueError(
                f"balance={balance!r} needs a measured profile (lightning_pipe.partition.measure.profile); "
                "PipelineStrategy measures one itself."
            )
        raise ValueError(
            f"Unknown balance {balance!r}. Valid: {', '.join(BALANCE_MODES)}, or a list of layer counts per stage."
        )
    if num_layers < num_stages:
        balance_uniform(num_layers, num_stages)  # raises the "more stages than layers" error
    return check_balance(balance, num_layers, num_stages)


def check_stage_parameters(
    balance: Sequence[int],
    layers: Layers,
    processes: Sequence[Sequence[int]],
    owners: Sequence[bool],
    devices: str = "devices",
) -> None:
    """Refuse a split that leaves a process without any parameter (its stages' layers hold none, and
    the module holds none outside them): its optimizer would fail with ``optimizer got an empty
    parameter list``. ``processes``: the split stages each process holds; ``devices``: how the
    run's process count is set, for the advice."""
    empty = set(stages_without_parameters(balance, owners))
    lacking = [held for held in processes if held and set(held) <= empty]
    if not lacking:
        return
    bounds = stage_bounds(balance)
    named = list(layers.named_children())
    stage = lacking[0][0]
    a, b = bounds[stage]
    what = ", ".join(f"{key}: {type(layer).__name__}" for key, layer in named[a:b])
    holding = sum(bool(o) for o in owners)
    fix = (
        f"every stage needs a layer with parameters, and the module has {holding} such layer(s) for {len(balance)} "
        f"stages: use at most {holding} {'processes' if len(balance) == len(processes) else 'stages'} ({devices}), "
        "or split the model into more layers that hold parameters"
    )
    if owning(owners, len(balance)) is not None:
        fix = (
            "give every stage a layer with parameters, for example "
            f"balance={balance_uniform(len(owners), len(balance), owners)}"
        )
    raise ValueError(
        f"balance={list(balance)} leaves stage {stage} with only layers that hold no parameters ({what}), so its "
        f"process's optimizer would get an empty parameter list: {fix}."
    )


def stage_layers(layers: Layers, balance: Sequence[int], stage: int) -> OrderedDict[str, nn.Module]:
    """The layers of ``stage`` keyed by their names in the unsplit Sequential (``"7"``, ...), so
    parameter names (``layers.7.weight``) survive the split."""
    start, stop = stage_bounds(balance)[stage]
    named = list(layers.named_children())
    return OrderedDict(named[start:stop])


def tied_parameters(layers: Layers, balance: Sequence[int], end_stages: Sequence[int] = ()) -> list[dict[int, str]]:
    """Parameters shared by layers of different stages (one tensor used in two places, like word
    embeddings tied to a language-model head), each as ``{stage: its name inside that stage}``,
    in a fixed order. Each stage keeps its own copy; their gradients must be summed. ``layers`` may
    end with layers beyond ``balance`` (a model's ends, see :mod:`lightning_pipe.partition.stages.ends`),
    on the stages ``end_stages``."""
    bounds = stage_bounds(balance)
    stage_of = [s for s, (a, b) in enumerate(bounds) for _ in range(a, b)] + list(end_stages)
    owners: dict[int, dict[int, str]] = {}
    for index, (key, layer) in enumerate(layers.named_children()):
        for name, param in layer.named_parameters(remove_duplicate=False):
            owners.setdefault(id(param), {}).setdefault(stage_of[index], f"{key}.{name}")
    return [where for where in owners.values() if len(where) > 1]


#: a parameter slot: the module that holds the parameter directly, its key there, and its path
Slot = tuple[nn.Module, str, str]


def foreign_parameters(module: nn.Module, layers: Layers, local: Sequence[int]) -> list[Slot]:
    """Where the modules outside ``layers`` hold directly a parameter that belongs to a layer of
    another stage only (by identity: BERT's head keeps its decoder's bias also as
    ``cls.predictions.bias``). Such a parameter is that stage's, not one outside the split layers,
    whatever name reaches it; left in place it would be summed over the stages as an outside
    parameter by the ranks that do not hold its layer and not by the one that does. Found before
    materialising, which gives a meta-built model's copies new identities."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    mine = {id(p) for i in local for p in layers[i].parameters()}
    foreign = {id(p) for i in range(len(layers)) if i not in set(local) for p in layers[i].parameters()} - mine
    slots: list[Slot] = []
    for path, owner in module.named_modules():
        if id(owner) in inside:
            continue
        for key, param in owner.named_parameters(recurse=False, remove_duplicate=False):
            if id(param) in foreign:
                slots.append((owner, key, f"{path}.{key}" if path else key))
    return slots


def release_parameters(slots: Sequence[Slot]) -> list[str]:
    """Remove the parameters of :func:`foreign_parameters` from the modules holding them (after
    materialising, whose initialisation may still set them); returns their paths."""
    for owner, key, _ in slots:
        if key in dict(owner.named_parameters(recurse=False, remove_duplicate=False)):
            delattr(owner, key)
    return [path for _, _, path in slots]


def release_foreign_parameters(module: nn.Module, layers: Layers, local: Sequence[int]) -> list[str]:
    """:func:`foreign_parameters` found and released at once (a module built with its tensors)."""
    return release_parameters(foreign_parameters(module, layers, local))


class Elsewhere(nn.Module):
    """Stands, outside the split layers, where the module held a piece of another stage's layers (a
    model kept beside the Sequential built from its parts): no tensors, so this rank keeps none of
    another stage's weights, and a clear error if called."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"This {self.kind} belongs to another pipeline stage's layers, so this rank does not hold it. Under the "
            "pipeline only the split layers run there; to use the whole model, load a consolidated checkpoint."
        )


def release_elsewhere(module: nn.Module, layers: Layers, local: Sequence[int], host: nn.Module) -> list[str]:
    """Replace every module reachable from ``module`` (outside ``host``, this rank's stage) that
    belongs only to layers of other stages by :class:`Elsewhere`, so that no attribute keeps another
    stage's tensors alive and parameters are classified by identity. Returns the paths replaced."""
    keep = {id(m) for i in local for m in layers[i].modules()}
    foreign = {id(m) for i in range(len(layers)) if i not in set(local) for m in layers[i].modules()} - keep
    replaced: list[str] = []

    def visit(parent: nn.Module, prefix: str, seen: set[int]) -> None:
        for key, child in module_slots(parent):
            if child is None or child is host or id(child) in seen:
                continue
            if id(child) in foreign:
                setattr(parent, key, Elsewhere(type(child).__name__))
                replaced.append(prefix + key)
                continue
            seen.add(id(child))
            visit(child, f"{prefix}{key}.", seen)

    visit(module, "", {id(module)})
    return replaced
