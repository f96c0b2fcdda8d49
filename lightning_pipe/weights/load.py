"""Start from a full set of weights, each process reading only its own stage's tensors.

``PipelineStrategy(weights=PATH)`` accepts

- a ``state_dict`` saved with ``torch.save`` (``.pt`` / ``.pth``),
- a Lightning checkpoint (``.ckpt``: its ``state_dict``),
- a lightning-pipe checkpoint directory (read with :mod:`lightning_pipe.checkpoint`),
- a ``.safetensors`` file,
- a directory written by Hugging Face ``save_pretrained`` (or a hub snapshot): ``model.safetensors``,
  or shards with their ``model.safetensors.index.json``, or the ``pytorch_model.bin`` forms (read
  with :mod:`lightning_pipe.weights.hf`, each process opening only the shards that hold its tensors).

Tensors are matched by their names in the unsplit module (``layers.7.weight``); a file named from
the model the module holds (``transformer.h.0...`` for ``self.model``'s ``model.transformer.h.0...``)
is matched by the one prefix that makes every name fit, and ``rename`` maps other layouts (see
:mod:`lightning_pipe.weights.names`). Files are read memory-mapped (``torch.load(mmap=True,
weights_only=True)``, ``safetensors.safe_open``), so a process reads from disk only the tensors it
copies. Before anything is copied, every process checks the file's names and shapes against the
whole model's (the same check with the same answer on every rank, so a bad file stops every rank
with the same error instead of a hang; the shapes in ``.bin`` shards are checked as they are
copied). A tensor shared by several names (tied weights; ``safetensors`` and ``save_pretrained``
store it once) is satisfied by any one of its names.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.checkpoint import is_pipeline_checkpoint, read_state_dict
from lightning_pipe.weights.hf import PRETRAINED_FILES, PretrainedFiles, pretrained_file, safetensors_shapes
from lightning_pipe.weights.hf_conversion import Conversion, conversion_of
from lightning_pipe.weights.names import NameMap, Rename, check_rename, mismatch_hint, name_map

FILE_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors")
_PATH = str | Path
_SHOWN = 8


def check_weights_argument(weights: _PATH | None) -> Path | None:
    """``PipelineStrategy(weights=...)`` checked where the strategy is built: a path to an
    existing file of a known kind, a lightning-pipe checkpoint directory or a ``save_pretrained``
    directory."""
    if weights is None:
        return None
    if not isinstance(weights, (str, Path)):
        raise TypeError(
            f"PipelineStrategy(weights={weights!r}): give the path of a weights file or checkpoint directory."
        )
    path = Path(weights).expanduser()
    if path.is_dir():
        if not is_pipeline_checkpoint(path) and pretrained_file(path) is None:
            raise ValueError(
                f"PipelineStrategy(weights={str(weights)!r}) is a directory but neither a lightning-pipe checkpoint "
                f"(it has no meta.pt) nor a Hugging Face save_pretrained directory (it has none of "
                f"{', '.join(PRETRAINED_FILES)}). Give such a directory, or a file: " + ", ".join(FILE_SUFFIXES) + "."
            )
        return path
    if not path.exists():
        raise FileNotFoundError(f"PipelineStrategy(weights={str(weights)!r}): no such file or directory.")
    if path.suffix not in FILE_SUFFIXES:
        raise ValueError(
            f"PipelineStrategy(weights={str(weights)!r}): unknown kind of file {path.suffix!r}. Valid: "
            + ", ".join(FILE_SUFFIXES)
            + ", a lightning-pipe checkpoint directory or a save_pretrained directory."
        )
    return path


@dataclass
class WeightSource:
    """The names and shapes a weights file holds (a shape None: known once read), and how to
    read one tensor."""

    path: Path
    shapes: dict[str, tuple[int, ...] | None]
    read: Callable[[str], Tensor]
    keep: list[Any] = field(default_factory=list)  # open handles the reads need
    files: PretrainedFiles | None = None  # a save_pretrained directory's files (which were opened)
    hint: str = ""  # how the names were matched, for errors


def open_weights(path: _PATH) -> WeightSource:
    """Open ``path`` without reading its tensors' data. Raises ``ValueError`` naming the file
    when it cannot be read as weights."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            return _open_safetensors(path)
        if path.is_dir() and not is_pipeline_checkpoint(path) and pretrained_file(path) is not None:
            return _open_pretrained(path)
        if path.is_dir():  # each tensor compared with its recorded checksum when it is read
            state, checked = read_state_dict(path)
            return replace(_from_mapping(path, state, None), read=checked)
        return _from_mapping(path, _state_dict(_torch_load(path)), None)
    except (FileNotFoundError, ValueError) as err:
        if str(path) in str(err):
            raise
        raise ValueError(f"Cannot read the weights {path}: {err}") from err
    except Exception as err:  # torch and safetensors raise many kinds for a damaged file
        raise ValueError(
            f"Cannot read the weights {path}: {type(err).__name__}: {err}. Expected a state_dict saved with "
            "torch.save, a Lightning .ckpt, a .safetensors file, a lightning-pipe checkpoint directory or a "
            "save_pretrained directory."
        ) from err


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)  # the legacy (non-zip) format


def _state_dict(loaded: Any) -> Mapping[str, Any]:
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        return loaded["state_dict"]  # a Lightning checkpoint
    if isinstance(loaded, Mapping):
        return loaded
    raise ValueError(f"it holds a {type(loaded).__name__}, not a state_dict (a mapping of names to tensors)")


def _from_mapping(path: Path, state: Mapping[str, Any], keep: Any) -> WeightSource:
    bad = [k for k, v in state.items() if not isinstance(v, Tensor)]
    if bad:
        raise ValueError(f"the entries {bad[:_SHOWN]} are not tensors; it is not a state_dict")
    return WeightSource(path, {k: tuple(v.shape) for k, v in state.items()}, lambda name: state[name], [keep])


def _open_pretrained(path: Path) -> WeightSource:
    try:
        files = PretrainedFiles(path)
    except (OSError, ValueError) as err:  # a damaged index or shard, named by the error
        raise ValueError(f"Cannot read the weights {path}: {err}") from err
    return WeightSource(path, files.shapes, files.read, [files], files)


def _open_safetensors(path: Path) -> WeightSource:
    from safetensors import safe_open

    try:
        safetensors_shapes(path)  # names the file when it is cut short, as safe_open's error does not
    except ValueError as err:
        raise ValueError(f"Cannot read the weights {path}: {err}") from err
    handle = safe_open(str(path), framework="pt", device="cpu")
    names = handle.keys()  # safe_open has keys() but no __iter__
    shapes: dict[str, tuple[int, ...] | None] = {name: tuple(handle.get_slice(name).get_shape()) for name in names}
    return WeightSource(path, shapes, handle.get_tensor, [handle])


@dataclass
class ModelSpec:
    """The whole model's tensor names and shapes, which names are one tensor, and where a Hugging
    Face model's task head is (see :class:`HeadOf`)."""

    shapes: dict[str, tuple[int, ...]]
    aliases: dict[str, list[str]]  # name -> every name of the same tensor (itself included)
    head: HeadOf | None = None
    conversion: Conversion | None = None  # how transformers converts a save_pretrained directory's names


@dataclass(frozen=True)
class HeadOf:
    """A Hugging Face model with a task head (``BertForSequenceClassification``): ``model`` is its
    path's prefix in the module (``"model."``), ``base`` its base model's (``"model.bert."``).
    Tensors under ``model`` but not under ``base`` are the head's: a checkpoint of the base model
    (or of another head on it) lacks them, and ``from_pretrained`` initialises them."""

    model: str
    base: str

    def holds(self, name: str) -> bool:
        return name.startswith(self.model) and not name.startswith(self.base)

    def absent_part(self, name: str, loaded: Collection[str]) -> bool:
        """Whether ``name`` lies in a direct part of the base model of which the file holds nothing
        while it holds others (BERT's pooler, which a masked-LM checkpoint's model does not build),
        which ``from_pretrained`` initialises too; a part the file holds in part (some of the blocks)
        does not fit."""
        if not name.startswith(self.base):
            return False
        part = self.base + name[len(self.base) :].split(".")[0] + "."
        return not any(n.startswith(part) for n in loaded) and any(n.startswith(self.base) for n in loaded)


def head_of(module: nn.Module) -> HeadOf | None:
    """Where the outermost Hugging Face model in ``module`` keeps its base model, when it has a head
    around it (told by ``base_model_prefix``, as transformers tells it); None otherwise."""
    for path, model in module.named_modules():
        prefix = getattr(type(model), "base_model_prefix", None)
        if not isinstance(prefix, str) or not prefix or not hasattr(model, "config"):
            continue
        base = getattr(model, prefix, None)
        if not isinstance(base, nn.Module) or base is model:
            return None
        at = f"{path}." if path else ""
        return HeadOf(at, f"{at}{prefix}.")
    return None


def model_spec(module: nn.Module) -> ModelSpec:
    """From the unsplit module (on the meta device or not)."""
    state = module.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    aliases = {n: groups[id(t)] for n, t in state.items()}
    return ModelSpec({k: tuple(v.shape) for k, v in state.items()}, aliases, head_of(module), conversion_of(module))


def converted(source: WeightSource, conversion: Conversion) -> WeightSource:
    """``source`` (a ``save_pretrained`` directory) named and read as ``from_pretrained`` loads it,
    where transformers converts its names (see :mod:`lightning_pipe.weights.hf_conversion`);
    unchanged where it does not. A converted tensor's shape is known once built (checked as it is
    copied)."""
    keys = list(source.shapes)
    if not conversion.converts(keys):
        return source
    plan = conversion.plan(keys)
    shapes = {name: source.shapes[srcs[0][0]] if srcs[0][1] is None else None for name, srcs in plan.items()}
    read = source.read
    built = sum(srcs[0][1] is not None for srcs in plan.values())
    renamed = sum(srcs[0][1] is None and srcs[0][0] != n[len(conversion.prefix) :] for n, srcs in plan.items())
    hint = (
        f"transformers converts this directory's names when it loads them ({built} tensors built by its converters, "
        f"{renamed} renamed); they were converted the same way. "
    )
    return replace(source, shapes=shapes, read=lambda name: conversion.build(name, plan[name], read), hint=hint)


def match_names(source: WeightSource, spec: ModelSpec, rename: Rename | None = None) -> WeightSource:
    """``source`` with its tensors named as the module names them: as they are when they fit,
    else by the one prefix that makes them all fit, or by ``rename`` (see
    :mod:`lightning_pipe.weights.names`). Raises ``ValueError`` when several prefixes fit."""
    names: NameMap = name_map(list(source.shapes), spec.aliases, rename, where=str(source.path))
    hint = source.hint + mismatch_hint(names, list(source.shapes), list(spec.shapes))
    if all(f == m for f, m in names.names.items()) and len(names.names) == len(source.shapes):
        return replace(source, hint=hint)
    back = {m: f for f, m in names.names.items()}
    read = source.read
    shapes = {m: source.shapes[f] for f, m in names.names.items()}
    return replace(source, shapes=shapes, read=lambda n: read(back[n]), hint=hint)


@dataclass(frozen=True)
class HeadFit:
    """What :func:`check_names` let pass as ``from_pretrained`` does: the head's tensors the file
    lacks, and a part of the base model it lacks whole (they keep the module's own initialisation),
    and those of another head that it holds (left unread)."""

    initialised: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)

    def line(self, path: Path) -> str:
        """One line, as transformers words it, or empty when the file fitted whole."""
        parts = []
        if self.initialised:
            parts.append(
                f"{_count(self.initialised, 'tensor')} of the model not in the checkpoint at {path} keep their new "
                f"initialisation (train them before use): {self.initialised}"
            )
        if self.unused:
            parts.append(f"{_count(self.unused, 'tensor')} of another head in it are not used: {self.unused}")
        return "lightning-pipe: " + "; ".join(parts) + "." if parts else ""


def check_names(source: WeightSource, spec: ModelSpec) -> HeadFit:
    """Fail, listing the names, when the file and the model disagree on names or shapes. As
    ``from_pretrained``, a Hugging Face model's head may be missing from a checkpoint of its base
    model (it keeps its initialisation) and another head's tensors may be left unused, provided the
    shapes agree and the file holds the base model (whole, or lacking whole parts, such as BERT's
    pooler); returns those names."""
    extra = sorted(set(source.shapes) - set(spec.shapes))
    missing = sorted(n for n in spec.shapes if not any(a in source.shapes for a in spec.aliases[n]))
    wrong = sorted(
        f"{n}: file {list(shape)}, model {list(spec.shapes[n])}"
        for n in spec.shapes
        if (shape := source.shapes.get(n)) is not None and shape != spec.shapes[n]
    )
    head = spec.head
    fit = HeadFit()
    if head is not None and not wrong and missing + extra:
        loaded = [n for n in spec.shapes if n not in set(missing)]
        if all(head.holds(n) or head.absent_part(n, loaded) for n in missing) and all(head.holds(n) for n in extra):
            fit, missing, extra = HeadFit(missing, extra), [], []
    problems = []
    if missing:
        problems.append(f"{_count(missing, 'name')} of the model not in the file: {_listed(missing)}")
    if extra:
        problems.append(f"{_count(extra, 'name')} in the file not in the model: {_listed(extra)}")
    if wrong:
        problems.append(f"{_count(wrong, 'shape')} differing: {_listed(wrong)}")
    if problems:
        raise ValueError(
            f"PipelineStrategy(weights={str(source.path)!r}) does not fit {len(spec.shapes)} tensors of the model: "
            + "; ".join(problems)
            + ". "
            + (source.hint or "Names are those of the unsplit LightningModule's state_dict (e.g. 'layers.0.weight').")
        )
    return fit


def _count(items: list[str], noun: str) -> str:
    return f"{len(items)} {noun}{'s' if len(items) != 1 else ''}"


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")


def load_local(module: nn.Module, source: WeightSource, spec: ModelSpec) -> int:
    """Copy the file's values into the tensors ``module`` holds (this rank's stage and the
    parameters outside the Sequential); reads nothing else. Returns the number of tensors copied."""
    copied: set[int] = set()
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=True).items():
            if id(t) in copied or t.is_meta:
                continue
            stored = next((a for a in spec.aliases.get(name, [name]) if a in source.shapes), None)
            if stored is None:  # a head the file lacks (check_names let it pass): its own initialisation
                continue
            value = source.read(stored)
            if tuple(value.shape) != tuple(t.shape):  # shapes a file's index does not give
                raise ValueError(
                    f"PipelineStrategy(weights={str(source.path)!r}): {stored} has shape {list(value.shape)} in "
                    f"the file, the model's {name} {list(t.shape)}."
                )
            t.copy_(value)
            copied.add(id(t))
    return len(copied)


def load_stage_weights(
    module: nn.Module,
    path: _PATH,
    spec: ModelSpec,
    rename: Rename | None = None,
    report: Callable[[str], None] | None = None,
) -> int:
    """Check ``path`` against the whole model (``spec``), its names matched to the module's (see
    :func:`match_names`; ``rename``: a mapping of file-name prefixes to module-name prefixes, or a
    callable file_name -> module_name, None leaving a tensor out), then load this rank's tensors;
    ``report`` is given one line saying how many tensors came from where (the caller decides where
    it shows: Lightning's setup lines)."""
    check_rename(rename)
    source = open_weights(path)
    if spec.conversion is not None and source.files is not None and rename is None:
        source = converted(source, spec.conversion)
    source = match_names(source, spec, rename)
    fit = check_names(source, spec)
    copied = load_local(module, source, spec)
    files = ""
    if source.files is not None:
        opened = len(set(source.files.opened))
        files = f" from {opened} of its {len(set(source.files.files.values()))} files"
    if report is not None:
        report(
            f"lightning-pipe: rank 0 loaded {copied} of the {len(source.shapes)} tensors in {source.path}{files} "
            "(its stage's and those outside the Sequential; the other ranks read theirs)"
        )
        if fit.line(source.path):
            report(fit.line(source.path))
    return copied
