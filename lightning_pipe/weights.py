"""Start from a full set of weights, each process reading only its own stage's tensors.

``PipelineStrategy(weights=PATH)`` accepts

- a ``state_dict`` saved with ``torch.save`` (``.pt`` / ``.pth``),
- a Lightning checkpoint (``.ckpt``: its ``state_dict``),
- a lightning-pipe checkpoint directory (read with :mod:`lightning_pipe.checkpoint`),
- a ``.safetensors`` file.

Tensors are matched by their names in the unsplit module (``layers.7.weight``). Files are read
memory-mapped (``torch.load(mmap=True, weights_only=True)``, ``safetensors.safe_open``), so a
process reads from disk only the tensors it copies. Before anything is copied, every process
checks the file's names and shapes against the whole model's (the same check with the same
answer on every rank, so a bad file stops every rank with the same error instead of a hang).
A tensor shared by several names (tied weights; ``safetensors`` stores it once) is satisfied by
any one of its names.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_pipe.checkpoint import is_pipeline_checkpoint, read_state_dict

FILE_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors")
_PATH = Union[str, Path]
_SHOWN = 8


def check_weights_argument(weights: Optional[_PATH]) -> Optional[Path]:
    """``PipelineStrategy(weights=...)`` checked where the strategy is built: a path to an
    existing file of a known kind or a lightning-pipe checkpoint directory."""
    if weights is None:
        return None
    if not isinstance(weights, (str, Path)):
        raise TypeError(f"PipelineStrategy(weights={weights!r}): give the path of a weights file or checkpoint directory.")
    path = Path(weights).expanduser()
    if path.is_dir():
        if not is_pipeline_checkpoint(path):
            raise ValueError(
                f"PipelineStrategy(weights={str(weights)!r}) is a directory but not a lightning-pipe checkpoint "
                "(it has no meta.pt). Give a checkpoint directory, or a file: " + ", ".join(FILE_SUFFIXES) + "."
            )
        return path
    if not path.exists():
        raise FileNotFoundError(f"PipelineStrategy(weights={str(weights)!r}): no such file or directory.")
    if path.suffix not in FILE_SUFFIXES:
        raise ValueError(
            f"PipelineStrategy(weights={str(weights)!r}): unknown kind of file {path.suffix!r}. Valid: "
            + ", ".join(FILE_SUFFIXES)
            + " or a lightning-pipe checkpoint directory."
        )
    return path


@dataclass
class WeightSource:
    """The names and shapes a weights file holds, and how to read one tensor."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    read: Callable[[str], Tensor]
    keep: list[Any] = field(default_factory=list)  # open handles the reads need


def open_weights(path: _PATH) -> WeightSource:
    """Open ``path`` without reading its tensors' data. Raises ``ValueError`` naming the file
    when it cannot be read as weights."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            return _open_safetensors(path)
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
            "torch.save, a Lightning .ckpt, a .safetensors file or a lightning-pipe checkpoint directory."
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


def _open_safetensors(path: Path) -> WeightSource:
    from safetensors import safe_open

    handle = safe_open(str(path), framework="pt", device="cpu")
    shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    return WeightSource(path, shapes, handle.get_tensor, [handle])


@dataclass
class ModelSpec:
    """The whole model's tensor names and shapes, and which names are one tensor."""

    shapes: dict[str, tuple[int, ...]]
    aliases: dict[str, list[str]]  # name -> every name of the same tensor (itself included)


def model_spec(module: nn.Module) -> ModelSpec:
    """From the unsplit module (on the meta device or not)."""
    state = module.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    return ModelSpec({k: tuple(v.shape) for k, v in state.items()}, {n: groups[id(t)] for n, t in state.items()})


def check_names(source: WeightSource, spec: ModelSpec) -> None:
    """Fail, listing the names, when the file and the model disagree on names or shapes."""
    extra = sorted(set(source.shapes) - set(spec.shapes))
    missing = sorted(n for n in spec.shapes if not any(a in source.shapes for a in spec.aliases[n]))
    wrong = sorted(
        f"{n}: file {list(source.shapes[n])}, model {list(spec.shapes[n])}"
        for n in spec.shapes
        if n in source.shapes and source.shapes[n] != spec.shapes[n]
    )
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
            + ". Names are those of the unsplit LightningModule's state_dict (for example 'layers.0.weight')."
        )


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
            stored = next(a for a in spec.aliases.get(name, [name]) if a in source.shapes)
            t.copy_(source.read(stored))
            copied.add(id(t))
    return len(copied)


def load_stage_weights(module: nn.Module, path: _PATH, spec: ModelSpec) -> int:
    """Check ``path`` against the whole model (``spec``), then load this rank's tensors."""
    source = open_weights(path)
    check_names(source, spec)
    copied = load_local(module, source, spec)
    rank_zero_info(  # where Lightning prints its own setup lines
        f"lightning-pipe: rank 0 loaded {copied} of the {len(source.shapes)} tensors in {source.path} "
        "(its stage's and those outside the Sequential; the other ranks read theirs)"
    )
    return copied


__all__ = [
    "FILE_SUFFIXES",
    "ModelSpec",
    "WeightSource",
    "check_names",
    "check_weights_argument",
    "load_local",
    "load_stage_weights",
    "model_spec",
    "open_weights",
]
