"""A ``save_pretrained`` directory whose names transformers converts when it loads them, converted
as transformers does, one target tensor at a time.

transformers 5 keeps some models' weights in another layout than it saves them: Mixtral's and
Qwen3-MoE's experts as one stacked tensor (``mlp.experts.gate_up_proj``) where the file holds one
per expert and projection, GPT-NeoX's head as ``lm_head`` where the file says ``embed_out``,
DINOv2's and ViT's attention under new names. ``from_pretrained`` converts them with the model's
*conversion mapping* (``transformers.conversion_mapping.get_model_conversion_mapping``: renamings
and converters, each converter a list of operations such as stacking and concatenating). Here the
same mapping, applied by transformers' own functions, gives each target tensor of the model the
file names it is built from; reading a target reads those tensors only and runs its converter's
operations on them, so a process reads and converts only its stage's tensors.

Needs transformers (5.x, checked with 5.24): only a module that holds a Hugging Face model with a
conversion mapping gets a :class:`Conversion`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn


@dataclass
class Conversion:
    """How transformers converts a checkpoint's names for the Hugging Face model at ``prefix`` in
    the module: its conversion mapping and what it needs to apply it (the model's own names, its
    base model's attribute, its config)."""

    prefix: str  # the model's path in the module, with its dot ("model.")
    renamings: list[Any]
    converters: list[Any]
    base_model_prefix: str
    names: dict[str, bool]  # the model's own tensor names (transformers asks .get(name) of them)
    config: Any

    def target(self, key: str) -> tuple[str, str | None]:
        """The model's name (without ``prefix``) that the file's ``key`` loads into, and the pattern
        of the converter that builds it (None: a renaming or the name as it is)."""
        from transformers.core_model_loading import rename_source_key

        target, pattern = rename_source_key(key, self.renamings, self.converters, self.base_model_prefix, self.names)
        if target not in self.names and key in self.names:  # as from_pretrained: a name that fits is not renamed
            target, pattern = rename_source_key(key, [], [], self.base_model_prefix, self.names)
        return target, pattern

    def plan(self, keys: list[str]) -> dict[str, list[tuple[str, str | None]]]:
        """Each target name the file's ``keys`` build (with ``prefix``), and its keys with their
        converter patterns, in transformers' order (its natural sort of the names); keys that fit
        no tensor of the model keep their own name, prefixed, for the check to list."""
        from transformers.core_model_loading import dot_natural_key

        out: dict[str, list[tuple[str, str | None]]] = {}
        for key in sorted(keys, key=dot_natural_key):
            target, pattern = self.target(key)
            name = self.prefix + (target if target in self.names else key)
            out.setdefault(name, []).append((key, pattern))
        return out

    def build(self, name: str, sources: list[tuple[str, str | None]], read: Callable[[str], Tensor]) -> Tensor:
        """The tensor ``name`` from its sources: read as it is, or through a copy of its converter
        (stacking experts, concatenating projections), given the reads to make as transformers'
        synchronous loading does."""
        key, pattern = sources[0]
        if pattern is None:
            return read(key)
        by_pattern = {p: c for c in self.converters for p in c.source_patterns}
        converter = copy.deepcopy(by_pattern[pattern])
        target = name[len(self.prefix) :]
        for key, pattern in sources:
            converter.add_tensor(target, key, pattern, lambda key=key: read(key))
        converted: Mapping[str, Tensor] = converter.convert(target, config=self.config)
        if target not in converted:
            raise ValueError(
                f"transformers' conversion of {[k for k, _ in sources]} gave {list(converted)}, not {target}"
            )
        return converted[target]

    def converts(self, keys: list[str]) -> bool:
        """Whether transformers would load any of ``keys`` under another name."""
        return any(self.target(key)[0] != key for key in keys)


def conversion_of(module: nn.Module) -> Conversion | None:
    """The conversion of the outermost Hugging Face model in ``module``, when transformers has one
    for it; None otherwise (and without transformers)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return None
    for path, model in module.named_modules():
        if not isinstance(model, PreTrainedModel):
            continue
        mapping = get_model_conversion_mapping(model)
        if not mapping:
            return None
        return Conversion(
            f"{path}." if path else "",
            [t for t in mapping if isinstance(t, WeightRenaming)],
            [t for t in mapping if isinstance(t, WeightConverter)],
            model.base_model_prefix,
            dict.fromkeys(model.state_dict(keep_vars=True), True),
            model.config,
        )
    return None
