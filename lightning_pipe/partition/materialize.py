"""Give a stage of a module built on the meta device real storage, and initialise it so that any
layout starts from the same weights.

A module whose layers are created in ``configure_model()`` (or under
``trainer.init_module(empty_init=True)``) holds only meta tensors: shapes without storage. Each
pipeline rank materialises the layers of its own stage and everything outside the split
``nn.Sequential``; the other stages' layers never get storage on it.

The initialisation rule (the same for 1, 2 or 4 stages, and for :func:`init_like_pipeline` in a
plain run):

- layer ``i`` of the Sequential is initialised from the random state ``torch.manual_seed(
  layer_seed(seed, i))``, by calling, children before parents, each of its modules'
  ``reset_parameters()`` (``_reset_parameters()`` where PyTorch names it so, as in
  ``nn.MultiheadAttention``). A parent's ``reset_parameters`` therefore has the last word, as in
  eager construction where a parent initialises after its children are built;
- the modules outside the Sequential that were built on the meta device are initialised the same
  way from ``layer_seed(seed, -1)``, children before parents (modules built eagerly keep their
  values);
- a tensor shared by several layers (tied embeddings) takes the value the first layer holding
  it gives it; later holders' resets do not change it. A rank that holds a later holder but not
  the first one initialises a temporary copy of the first layer to learn that value.

``seed`` is the run's seed (``lightning.seed_everything``, read from ``PL_GLOBAL_SEED``; 0 when
none was set).
"""

from __future__ import annotations

import copy
import hashlib
import os
from typing import Callable, ContextManager, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor, nn

OUTSIDE = -1  # the key of the modules outside the Sequential in layer_seed


def run_seed() -> int:
    """The seed of the run: what ``lightning.seed_everything`` set, or 0."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def layer_seed(seed: int, index: int) -> int:
    """The random seed of layer ``index`` (``OUTSIDE`` for the modules outside the Sequential)."""
    digest = hashlib.sha256(f"lightning-pipe:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _direct(module: nn.Module) -> Iterator[tuple[str, Optional[Tensor], bool]]:
    for name, t in module._parameters.items():
        yield name, t, True
    for name, t in module._buffers.items():
        yield name, t, False


def outside_modules(module: nn.Module, layers: nn.Sequential) -> list[nn.Module]:
    """The modules of ``module`` that are not the Sequential ``layers`` or inside it."""
    inside = {id(m) for m in layers.modules()}
    return [m for m in module.modules() if id(m) not in inside]


def first_holders(layers: nn.Sequential) -> dict[int, tuple[int, str]]:
    """``id(tensor)`` -> (index of the first layer that holds it, its name in that layer)."""
    owners: dict[int, tuple[int, str]] = {}
    for index, layer in enumerate(layers):
        named = list(layer.named_parameters(remove_duplicate=False)) + list(layer.named_buffers(remove_duplicate=False))
        for name, t in named:
            owners.setdefault(id(t), (index, name))
    return owners


def allocate(modules: Iterable[nn.Module], device: Union[str, torch.device]) -> dict[int, Tensor]:
    """Replace every meta parameter and buffer of ``modules`` (their own, not recursively) by an
    uninitialised tensor on ``device``; a tensor held in several places stays one tensor. Returns
    ``id(meta tensor)`` -> its replacement."""
    made: dict[int, Tensor] = {}
    for m in modules:
        for name, t, is_param in list(_direct(m)):
            if t is None or not t.is_meta:
                continue
            if id(t) not in made:
                real = torch.empty_like(t, device=device)
                made[id(t)] = nn.Parameter(real, requires_grad=t.requires_grad) if is_param else real
            if is_param:
                m._parameters[name] = made[id(t)]  # type: ignore[assignment]
            else:
                m._buffers[name] = made[id(t)]
    return made


def _reset_fn(m: nn.Module) -> Optional[Callable[[], None]]:
    fn = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
    return fn if callable(fn) else None


def check_initializable(module: nn.Module) -> None:
    """Every module holding meta tensors of its own must say how to initialise them. Checked on
    the whole model, so every rank gives the same answer before any rank materialises anything."""
    for path, m in module.named_modules():
        own = [name for name, t, _ in _direct(m) if t is not None and t.is_meta]
        if own and _reset_fn(m) is None:
            raise TypeError(
                f"{path or 'the module'} ({type(m).__name__}) holds tensors of its own ({', '.join(own)}) but has no "
                "reset_parameters(), so it cannot be initialised after being built on the meta device. Define "
                "reset_parameters() on it (setting every tensor the module holds directly), or build the model "
                "eagerly instead of in configure_model()."
            )


def reset(unit: nn.Module, skip: Optional[nn.Module] = None, only: Optional[set[int]] = None) -> None:
    """Initialise ``unit`` as its modules define it, children before parents (``skip``'s subtree
    left out; with ``only``, just the modules whose subtree holds one of those tensors)."""
    for m in _post_order(unit, {id(skip)} if skip is not None else set()):
        if only is not None and not any(id(t) in only for t in _subtree_tensors(m, skip)):
            continue
        fn = _reset_fn(m)
        if fn is not None:
            fn()
        elif any(t is not None for _, t, _ in _direct(m)):
            raise TypeError(f"{type(m).__name__} holds tensors of its own but has no reset_parameters() to initialise them.")


def _subtree_tensors(module: nn.Module, skip: Optional[nn.Module]) -> Iterator[Tensor]:
    for m in _post_order(module, {id(skip)} if skip is not None else set()):
        yield from (t for _, t, _ in _direct(m) if t is not None)


def _post_order(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    if id(module) in seen:
        return
    seen.add(id(module))
    for child in module.children():
        yield from _post_order(child, seen)
    yield module


def _seeded(device: torch.device) -> ContextManager[None]:
    """The CPU's and ``device``'s random state, restored on exit."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _first_holder_value(layers: nn.Sequential, index: int, name: str, seed: int, device: torch.device) -> Tensor:
    """The value layer ``index`` gives its tensor ``name``, from a temporary copy of that layer."""
    twin = copy.deepcopy(layers[index])
    allocate(twin.modules(), device)
    _reset_seeded(twin, layer_seed(seed, index), device)
    values = dict(twin.named_parameters(remove_duplicate=False)) | dict(twin.named_buffers(remove_duplicate=False))
    return values[name].detach()


def _reset_seeded(
    unit: nn.Module, seed: int, device: torch.device, skip: Optional[nn.Module] = None, only: Optional[set[int]] = None
) -> None:
    with _seeded(device):
        torch.manual_seed(seed)
        with torch.no_grad():
            reset(unit, skip, only)


def initialize(
    module: nn.Module,
    layers: nn.Sequential,
    fresh: Sequence[int],
    local: Sequence[int],
    owners: dict[int, tuple[int, str]],
    seed: int,
    device: Union[str, torch.device],
    outside: bool = True,
    outside_only: Optional[set[int]] = None,
) -> None:
    """Initialise the layers ``fresh`` of ``layers`` (and, with ``outside``, the modules outside
    it: with ``outside_only``, those holding one of these tensors) by the rule in the module
    docstring. ``local`` are the layers with storage here (the others may be on the meta device);
    ``owners`` is :func:`first_holders` of the layers, taken before any tensor got storage and
    keyed by the tensors now held."""
    device = torch.device(device)
    units: list[tuple[int, list[nn.Module]]] = [(i, list(layers[i].modules())) for i in sorted(fresh)]
    if outside:
        units.append((OUTSIDE, outside_modules(module, layers)))
    for key, members in units:
        held = {id(t): t for m in members for _, t, _ in _direct(m) if t is not None}
        kept: dict[int, Tensor] = {}
        for ident, t in held.items():
            owner, name = owners.get(ident, (key, ""))
            if owner == key:
                continue
            if owner in local:
                kept[ident] = t.detach().clone()  # its first holder's value, set before this unit
            else:
                kept[ident] = _first_holder_value(layers, owner, name, seed, device)
        if key == OUTSIDE:
            _reset_seeded(module, layer_seed(seed, key), device, skip=layers, only=outside_only)
        else:
            _reset_seeded(layers[key], layer_seed(seed, key), device)
        with torch.no_grad():
            for ident, value in kept.items():
                held[ident].copy_(value)


def materialize(
    module: nn.Module, layers: nn.Sequential, local: Sequence[int], device: Union[str, torch.device], seed: Optional[int] = None
) -> None:
    """Give storage on ``device`` to the meta tensors of the layers ``local`` of ``layers`` and
    of the modules outside it, and initialise the parts that were on the meta device (see the
    module docstring). The other layers stay on the meta device."""
    seed = run_seed() if seed is None else seed
    check_initializable(module)
    outside = outside_modules(module, layers)
    fresh = [i for i in local if has_meta_tensors(layers[i])]
    fresh_outside = any(t is not None and t.is_meta for m in outside for _, t, _ in _direct(m))
    owners = first_holders(layers)
    made = allocate([m for i in local for m in layers[i].modules()] + outside, device)
    owners = {id(made[k]) if k in made else k: v for k, v in owners.items()}
    made_ids = {id(t) for t in made.values()}
    initialize(module, layers, fresh, local, owners, seed, device, fresh_outside, outside_only=made_ids)


def init_like_pipeline(
    module: nn.Module, seed: Optional[int] = None, sequential: Optional[str] = None, device: Union[str, torch.device, None] = None
) -> nn.Module:
    """Initialise ``module`` exactly as ``PipelineStrategy`` initialises a module built in
    ``configure_model()``, so that a plain run starts from the weights a pipeline of any depth
    starts from. Give it the module built on the meta device (``with torch.device("meta"):
    model.configure_model()``): its tensors get storage on ``device`` (default: CPU). On a module
    without meta tensors every layer and the modules outside the Sequential are re-initialised.
    ``seed`` defaults to the run's seed; ``sequential`` names the ``nn.Sequential`` to split, as
    ``PipelineStrategy(module=...)`` does. Returns ``module``."""
    from lightning_pipe.partition.split import find_sequential

    _, layers = find_sequential(module, sequential)
    everything = range(len(layers))
    seed = run_seed() if seed is None else seed
    if has_meta_tensors(module):
        materialize(module, layers, everything, torch.device("cpu") if device is None else device, seed)
        return module
    first = next(iter(_tensors(module)), None)
    device = (first.device if first is not None else torch.device("cpu")) if device is None else device
    initialize(module, layers, everything, everything, first_holders(layers), seed, device)
    return module


__all__ = [
    "OUTSIDE",
    "allocate",
    "check_initializable",
    "first_holders",
    "has_meta_tensors",
    "init_like_pipeline",
    "initialize",
    "layer_seed",
    "materialize",
    "outside_modules",
    "reset",
    "run_seed",
]
