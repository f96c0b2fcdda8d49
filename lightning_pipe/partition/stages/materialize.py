"""Give a stage of a module built on the meta device real storage, and initialise it so that any
layout starts from the same weights.

A module whose layers are created in ``configure_model()`` (or under
``trainer.init_module(empty_init=True)``) holds only meta tensors: shapes without storage. Each
pipeline rank materialises the layers of its own stage and everything outside the split
``nn.Sequential``; the other stages' layers never get storage on it.

The initialisation rule (the same for 1, 2 or 4 stages, and for :func:`init_like_pipeline` in a
plain run):

- layer ``i`` of the Sequential (or of a block container, ``nn.ModuleList``) is initialised
  from the random state ``torch.manual_seed(layer_seed(seed, i))``, by initialising its modules
  children before parents. A parent therefore has the last word, as in eager construction where
  a parent initialises after its children are built. Each module is initialised by (see
  :class:`Initializer`):

  - the ``init`` hook when one is given: ``init(module)`` for every module;
  - otherwise, for a module inside a Hugging Face ``PreTrainedModel``, that model's own
    ``_init_weights(module)``, as ``post_init()`` would have (HF's rules, e.g. GPT-2's scaled
    residual projections; see :mod:`lightning_pipe.partition.stages.hf_init`);
  - otherwise its ``reset_parameters()`` (``_reset_parameters()`` where PyTorch names it so, as
    in ``nn.MultiheadAttention``).

  Fresh floating-point storage starts as NaN, so a tensor that none of these set is found and
  named instead of training from uninitialised memory; a module that the hook or HF's rule left
  wholly untouched falls back to its ``reset_parameters()`` (what eager construction gave it);
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

import contextlib
import copy
import functools
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.partition.stages.ends import extended, model_ends
from lightning_pipe.partition.stages.hf_init import hf_init_context, init_with_owner, pretrained_owners
from lightning_pipe.torch_internals import private_reset_parameters

OUTSIDE = -1  # the key of the modules outside the Sequential in layer_seed
ModuleInit = Callable[[nn.Module], None]  # initialise one module's own tensors (the ``init`` hook)
Blocks = nn.Sequential | nn.ModuleList  # the layers split into stages


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


def _direct(module: nn.Module) -> Iterator[tuple[str, Tensor | None, bool]]:
    for name, t in module.named_parameters(recurse=False, remove_duplicate=False):
        yield name, t, True
    for name, buffer in module.named_buffers(recurse=False, remove_duplicate=False):
        yield name, buffer, False


def outside_modules(module: nn.Module, layers: Blocks) -> list[nn.Module]:
    """The modules of ``module`` that are not the Sequential ``layers`` or inside it."""
    inside = {id(m) for m in layers.modules()}
    return [m for m in module.modules() if id(m) not in inside]


def first_holders(layers: Blocks) -> dict[int, tuple[int, str]]:
    """``id(tensor)`` -> (index of the first layer that holds it, its name in that layer)."""
    owners: dict[int, tuple[int, str]] = {}
    for index, layer in enumerate(layers):
        named = list(layer.named_parameters(remove_duplicate=False)) + list(layer.named_buffers(remove_duplicate=False))
        for name, t in named:
            owners.setdefault(id(t), (index, name))
    return owners


def allocate(modules: Iterable[nn.Module], device: str | torch.device) -> dict[int, Tensor]:
    """Replace every meta parameter and buffer of ``modules`` (their own, not recursively) by a
    tensor on ``device`` (NaN where floating point, so that what initialisation misses shows;
    uninitialised otherwise); a tensor held in several places stays one tensor. Returns
    ``id(meta tensor)`` -> its replacement."""
    made: dict[int, Tensor] = {}
    for m in modules:
        for name, t, is_param in list(_direct(m)):
            if t is None or not t.is_meta:
                continue
            if id(t) not in made:
                floating = t.is_floating_point()
                real = (
                    torch.full_like(t, float("nan"), device=device) if floating else torch.empty_like(t, device=device)
                )
                made[id(t)] = nn.Parameter(real, requires_grad=t.requires_grad) if is_param else real
            setattr(m, name, made[id(t)])  # a parameter stays one, a buffer keeps its persistence
    return made


def _reset_fn(m: nn.Module) -> Callable[[], None] | None:
    fn = getattr(m, "reset_parameters", None)
    return fn if callable(fn) else private_reset_parameters(m)


class Initializer:
    """How each module of one model initialises its own tensors: ``init(module)`` when the hook
    is given; otherwise, inside a Hugging Face ``PreTrainedModel``, that model's
    ``_init_weights(module)``; otherwise ``reset_parameters()``. Built once from the whole model
    (``root``), since a block alone does not know the ``PreTrainedModel`` around it."""

    def __init__(self, root: nn.Module | None = None, init: ModuleInit | None = None) -> None:
        if init is not None and not callable(init):
            raise TypeError(f"init={init!r}: give a callable init(module) -> None that sets the module's own tensors.")
        self.init = init
        self.owners: dict[int, nn.Module] = pretrained_owners(root) if root is not None and init is None else {}

    def how(self, module: nn.Module) -> Callable[[], None] | None:
        """The call that initialises ``module``'s own tensors, or None when there is none."""
        if self.init is not None:
            return functools.partial(self.init, module)
        owner = self.owners.get(id(module))
        if owner is not None:
            return functools.partial(init_with_owner, owner, module)
        return _reset_fn(module)

    def context(self) -> AbstractContextManager[Any]:
        """What the walk runs under (HF's guard of ``torch.nn.init`` when HF models take part)."""
        return hf_init_context() if self.owners and self.init is None else contextlib.nullcontext()

    def for_copy(self, original: nn.Module, twin: nn.Module) -> Initializer:
        """The same rule for ``twin``, a ``copy.deepcopy`` of ``original`` (a module of the root)."""
        copied = copy.copy(self)
        copied.owners = dict(self.owners)
        for a, b in zip(original.modules(), twin.modules()):
            if id(a) in self.owners:
                copied.owners[id(b)] = self.owners[id(a)]
        return copied


def check_initializable(module: nn.Module, initializer: Initializer | None = None) -> None:
    """Every module holding meta tensors of its own must have a way to initialise them. Checked on
    the whole model, so every rank gives the same answer before any rank materialises anything.
    With an ``init`` hook the hook answers for every module."""
    initializer = Initializer(module) if initializer is None else initializer
    for path, m in module.named_modules():
        own = [name for name, t, _ in _direct(m) if t is not None and t.is_meta]
        if own and initializer.how(m) is None:
            raise TypeError(
                f"{path or 'the module'} ({type(m).__name__}) holds tensors of its own ({', '.join(own)}) but has no "
                "reset_parameters() and is not part of a Hugging Face PreTrainedModel, so it cannot be initialised "
                "after being built on the meta device. Define reset_parameters() on it (setting every tensor the "
                "module holds directly), give an init hook (init=, a callable init(module) called on every module), "
                "or build the model eagerly instead of in configure_model()."
            )


def reset(
    unit: nn.Module,
    skip: nn.Module | None = None,
    only: set[int] | None = None,
    initializer: Initializer | None = None,
    exempt: frozenset[int] = frozenset(),
    where: str = "",
) -> None:
    """Initialise ``unit``'s modules by ``initializer``'s rule (default: ``reset_parameters()``),
    children before parents (``skip``'s subtree left out; with ``only``, just the modules whose
    subtree holds one of those tensors). Then every floating-point tensor still NaN from
    :func:`allocate` (but those in ``exempt``, which the caller sets afterwards) is found: a
    module the rule left wholly unset falls back to its ``reset_parameters()``; anything else
    unset is an error naming it (``where``: the unit's path in the model, for that error)."""
    initializer = Initializer() if initializer is None else initializer
    walked = [
        m for m in _post_order(unit, _skipped(skip))
        if only is None or any(id(t) in only for t in _subtree_tensors(m, skip))
    ]  # fmt: skip
    with initializer.context():
        for m in walked:
            fn = initializer.how(m)
            if fn is not None:
                fn()
            elif any(t is not None for _, t, _ in _direct(m)):
                raise TypeError(
                    f"{type(m).__name__} holds tensors of its own but has no reset_parameters() to initialise them "
                    "(give an init hook, init=, to initialise it)."
                )
    paths = {id(m): ".".join(p for p in (where, name) if p) for name, m in unit.named_modules(remove_duplicate=False)}
    _check_set([(paths.get(id(m), ""), m) for m in walked], only, exempt)


def _unset(m: nn.Module, only: set[int] | None, exempt: frozenset[int]) -> list[str]:
    return [
        name for name, t, _ in _direct(m)
        if t is not None and t.is_floating_point() and (only is None or id(t) in only) and id(t) not in exempt
        and _has_nan(t)
    ]  # fmt: skip


def _has_nan(t: Tensor) -> bool:
    """Whether ``t`` holds a NaN: its maximum propagates one, in one pass and without the
    tensor-sized mask ``isnan`` would allocate."""
    return t.numel() > 0 and bool(t.detach().max().isnan())


def _check_set(modules: list[tuple[str, nn.Module]], only: set[int] | None, exempt: frozenset[int]) -> None:
    for path, m in modules:
        unset = _unset(m, only, exempt)
        if not unset:
            continue
        fn = _reset_fn(m)
        whole = len(unset) == sum(1 for _, t, _ in _direct(m) if t is not None and t.is_floating_point())
        if fn is not None and whole:
            fn()  # untouched by the hook or HF's rule: what eager construction gave it
            unset = _unset(m, only, exempt)
        if unset:
            raise ValueError(
                f"{path + ' ' if path else ''}({type(m).__name__}): its tensors {', '.join(unset)} are not set by its "
                "initialisation (init hook, PreTrainedModel._init_weights or reset_parameters(); they hold NaN) "
                "after the module was built on the meta device. Initialise every tensor the module holds directly: "
                "give an init hook (init=) that covers it, or define reset_parameters() on it."
            )


def _skipped(skip: nn.Module | None) -> set[int]:
    """What a walk leaves out: ``skip`` and, for a list of layers (which may gather modules from
    anywhere in the model, as the layers and ends of :mod:`lightning_pipe.partition.stages.ends` do), each
    of its layers."""
    if skip is None:
        return set()
    if isinstance(skip, (nn.ModuleList, nn.Sequential)):
        return {id(skip)} | {id(layer) for layer in skip}
    return {id(skip)}


def _subtree_tensors(module: nn.Module, skip: nn.Module | None) -> Iterator[Tensor]:
    for m in _post_order(module, _skipped(skip)):
        yield from (t for _, t, _ in _direct(m) if t is not None)


def _post_order(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    if id(module) in seen:
        return
    seen.add(id(module))
    for child in module.children():
        yield from _post_order(child, seen)
    yield module


def _seeded(device: torch.device) -> AbstractContextManager[None]:
    """The CPU's and ``device``'s random state, restored on exit."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _fill_from_first_holder(
    layers: Blocks, index: int, name: str, target: Tensor, seed: int, device: torch.device, initializer: Initializer
) -> None:
    """Write into ``target`` the value layer ``index`` gives its tensor ``name``, from a temporary
    copy of that layer in which that tensor is ``target`` itself (a tied embedding is not held twice)."""
    twin = copy.deepcopy(layers[index])
    copied = dict(twin.named_parameters(remove_duplicate=False)) | dict(twin.named_buffers(remove_duplicate=False))
    placeholder = copied[name]
    for m in twin.modules():  # every place the copy holds it
        for key, t, is_param in list(_direct(m)):
            if t is placeholder:
                setattr(m, key, nn.Parameter(target) if is_param and not isinstance(target, nn.Parameter) else target)
    allocate(twin.modules(), device)
    _reset_seeded(twin, layer_seed(seed, index), device, initializer=initializer.for_copy(layers[index], twin))


def _reset_seeded(
    unit: nn.Module,
    seed: int,
    device: torch.device,
    skip: nn.Module | None = None,
    only: set[int] | None = None,
    initializer: Initializer | None = None,
    exempt: frozenset[int] = frozenset(),
    where: str = "",
) -> None:
    with _seeded(device):
        torch.manual_seed(seed)
        with torch.no_grad():
            reset(unit, skip, only, initializer, exempt, where)


def initialize(  # noqa: PLR0913  what to initialise where (fresh, local, outside); a record is follow-up work
    module: nn.Module,
    layers: Blocks,
    fresh: Sequence[int],
    local: Sequence[int],
    owners: dict[int, tuple[int, str]],
    seed: int,
    device: str | torch.device,
    outside: bool = True,
    outside_only: set[int] | None = None,
    init: ModuleInit | None = None,
) -> None:
    """Initialise the layers ``fresh`` of ``layers`` (and, with ``outside``, the modules outside
    it: with ``outside_only``, those holding one of these tensors) by the rule in the module
    docstring (``init``: the hook called on every module instead of the default rule).
    ``local`` are the layers with storage here (the others may be on the meta device);
    ``owners`` is :func:`first_holders` of the layers, taken before any tensor got storage and
    keyed by the tensors now held."""
    device = torch.device(device)
    initializer = Initializer(module, init)
    units: list[tuple[int, list[nn.Module]]] = [(i, list(layers[i].modules())) for i in sorted(fresh)]
    if outside:
        units.append((OUTSIDE, outside_modules(module, layers)))
    for key, members in units:
        held = {id(t): t for m in members for _, t, _ in _direct(m) if t is not None}
        kept: dict[int, Tensor] = {}
        elsewhere: dict[int, tuple[int, str]] = {}
        for ident, t in held.items():
            owner, name = owners.get(ident, (key, ""))
            if owner == key:
                continue
            if owner in local:
                kept[ident] = t.detach().clone()  # its first holder's value, set before this unit
            else:
                elsewhere[ident] = (owner, name)
        exempt = frozenset(kept) | frozenset(elsewhere)
        if key == OUTSIDE:
            _reset_seeded(module, layer_seed(seed, key), device, layers, outside_only, initializer, exempt)
        else:
            where = next((n for n, m in module.named_modules() if m is layers[key]), "")
            _reset_seeded(layers[key], layer_seed(seed, key), device, None, None, initializer, exempt, where)
        with torch.no_grad():
            for ident, value in kept.items():
                held[ident].copy_(value)
        for ident, (owner, name) in elsewhere.items():  # after the unit: its own random draws unchanged
            _fill_from_first_holder(layers, owner, name, held[ident], seed, device, initializer)


def materialize(
    module: nn.Module,
    layers: Blocks,
    local: Sequence[int],
    device: str | torch.device,
    seed: int | None = None,
    init: ModuleInit | None = None,
) -> None:
    """Give storage on ``device`` to the meta tensors of the layers ``local`` of ``layers`` (an
    ``nn.Sequential`` or ``nn.ModuleList`` inside ``module``) and of the modules outside it, and
    initialise the parts that were on the meta device (see the module docstring; ``init``: a hook
    ``init(module)`` called on every module instead of the default rule). The other layers stay
    on the meta device."""
    seed = run_seed() if seed is None else seed
    check_initializable(module, Initializer(module, init))
    outside = outside_modules(module, layers)
    fresh = [i for i in local if has_meta_tensors(layers[i])]
    fresh_outside = any(t is not None and t.is_meta for m in outside for _, t, _ in _direct(m))
    owners = first_holders(layers)
    made = allocate([m for i in local for m in layers[i].modules()] + outside, device)
    owners = {id(made[k]) if k in made else k: v for k, v in owners.items()}
    made_ids = {id(t) for t in made.values()}
    initialize(module, layers, fresh, local, owners, seed, device, fresh_outside, outside_only=made_ids, init=init)


def init_like_pipeline(
    module: nn.Module,
    seed: int | None = None,
    sequential: str | None = None,
    device: str | torch.device | None = None,
    init: ModuleInit | None = None,
    first_stage: Sequence[str] | None = None,
    last_stage: Sequence[str] | None = None,
) -> nn.Module:
    """Initialise ``module`` exactly as ``PipelineStrategy`` initialises a module built in
    ``configure_model()``, so that a plain run starts from the weights a pipeline of any depth
    starts from. Give it the module built on the meta device (``with torch.device("meta"):
    model.configure_model()``): its tensors get storage on ``device`` (default: CPU). On a module
    without meta tensors every layer and the modules outside the Sequential are re-initialised.
    ``seed`` defaults to the run's seed; ``sequential`` names the ``nn.Sequential`` to split, as
    ``PipelineStrategy(module=...)`` does, or is a dotted path to a block container
    (``"model.transformer.h"``, an ``nn.ModuleList`` or ``nn.Sequential``) whose entries are the
    layers; ``init`` is the per-module hook (default: the rule in the module docstring); ``first_stage`` and
    ``last_stage``: the end modules as ``PipelineStrategy`` is given them. Returns ``module``."""
    layers = _layers(module, sequential, first_stage, last_stage)
    everything = range(len(layers))
    seed = run_seed() if seed is None else seed
    if has_meta_tensors(module):
        materialize(module, layers, everything, torch.device("cpu") if device is None else device, seed, init)
        return module
    first = next(iter(_tensors(module)), None)
    device = (first.device if first is not None else torch.device("cpu")) if device is None else device
    initialize(module, layers, everything, everything, first_holders(layers), seed, device, init=init)
    return module


def _layers(
    module: nn.Module, path: str | None, first_stage: Sequence[str] | None, last_stage: Sequence[str] | None
) -> Blocks:
    """The layers ``init_like_pipeline`` initialises one by one: as the pipeline does, a block
    container's blocks followed by the model's ends (see :mod:`lightning_pipe.partition.stages.ends`)."""
    from lightning_pipe.partition.stages.split import find_sequential

    if path is None or "." not in path:
        layers = find_sequential(module, path)[1]
        return extended(layers, model_ends(module, layers, first_stage, last_stage))
    try:
        found = module.get_submodule(path)
    except AttributeError as err:
        raise ValueError(
            f"init_like_pipeline(sequential={path!r}): {type(module).__name__} has no submodule {path!r} ({err})."
        ) from err
    if not isinstance(found, (nn.Sequential, nn.ModuleList)):
        raise TypeError(
            f"init_like_pipeline(sequential={path!r}) is a {type(found).__name__}; give the path of the "
            "nn.ModuleList or nn.Sequential that holds the model's repeated blocks."
        )
    return extended(found, model_ends(module, found, first_stage, last_stage))
