"""Which name in a weights file is which tensor of the module: pure logic over names.

A file saved from the model itself (``save_pretrained``, a Hugging Face hub checkpoint) names its
tensors from the model (``transformer.h.0.attn.c_attn.weight``), while the LightningModule that
holds the model as an attribute names them from itself (``model.transformer.h.0.attn.c_attn.weight``).
The two differ by one prefix, the model's attribute path in the module. :func:`name_map` finds it:

- names that already fit are taken as they are;
- otherwise the one prefix ``P`` such that ``P + name`` is a module name for every file name is
  added (preferring, among several, the one that reaches every module tensor; a tie stored once
  reaches all its names), and the usual check then lists any module tensor left unreached;
- several such prefixes (two copies of one model in the module), or none: an error that shows
  examples of both sides and asks for ``rename``.

``rename`` maps other layouts explicitly: a mapping of file-name prefixes (or whole names) to
module-name prefixes, the longest matching key winning, or a callable ``file_name ->
module_name``; ``None`` (as a mapping value or a callable's answer) leaves the tensor out of the
load (e.g. buffers an old checkpoint stored that the model no longer has).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

Rename = Mapping[str, str | None] | Callable[[str], str | None]
_SHOWN = 4


@dataclass(frozen=True)
class NameMap:
    """File name -> module name for every tensor of the file that is loaded, and how it was found."""

    names: dict[str, str]
    prefix: str | None = None  # the prefix found and added, when the names were matched that way
    renamed: bool = False  # given by ``rename``


def check_rename(rename: Rename | None) -> None:
    """``rename`` is None, a mapping of strings to strings (or None), or a callable."""
    if rename is None or callable(rename):
        return
    if isinstance(rename, Mapping):
        bad = [k for k, v in rename.items() if not isinstance(k, str) or not (v is None or isinstance(v, str))]
        if not bad:
            return
        raise TypeError(
            f"rename={rename!r}: the entries {bad[:_SHOWN]} are not str -> str (or None to leave a tensor out). "
            "Map file-name prefixes to module-name prefixes, e.g. {'transformer.': 'model.transformer.'}."
        )
    raise TypeError(
        f"rename={rename!r}: give a mapping of file-name prefixes to module-name prefixes "
        "(e.g. {'transformer.': 'model.transformer.'}) or a callable file_name -> module_name (None to leave it out)."
    )


def apply_rename(file_names: Collection[str], rename: Rename) -> dict[str, str]:
    """File name -> module name under ``rename`` (names it maps to None are left out). Two file
    names mapped to one module name are an error."""
    check_rename(rename)
    if callable(rename):
        mapped = {f: rename(f) for f in file_names}
    else:
        keys = sorted(rename, key=len, reverse=True)  # the longest matching prefix wins
        mapped = {}
        for f in file_names:
            key = next((k for k in keys if f.startswith(k)), None)
            if key is None:
                mapped[f] = f
            else:
                new = rename[key]
                mapped[f] = None if new is None else new + f[len(key) :]
    bad = [f"{f!r} -> {m!r}" for f, m in mapped.items() if m is not None and not isinstance(m, str)]
    if bad:
        raise TypeError(f"rename gave names that are not strings: {', '.join(bad[:_SHOWN])}.")
    result = {f: m for f, m in mapped.items() if m is not None}
    seen: dict[str, str] = {}
    for f, m in result.items():
        if m in seen:
            raise ValueError(f"rename maps both {seen[m]!r} and {f!r} to {m!r}; a module name takes one file name.")
        seen[m] = f
    return result


def name_map(
    file_names: Collection[str],
    aliases: Mapping[str, list[str]],
    rename: Rename | None = None,
    where: str = "the file",
) -> NameMap:
    """How the names of a file map to the module's. ``aliases`` is every module name -> all names
    of the same tensor (itself included); ``where`` names the file in errors."""
    if rename is not None:
        return NameMap(apply_rename(file_names, rename), renamed=True)
    model = set(aliases)
    if all(f in model for f in file_names) or not file_names:
        return NameMap({f: f for f in file_names})
    fits = _prefix_votes(file_names, model)
    landing = sorted(p for p, n in fits.items() if n == len(file_names))  # every file name is a module name
    full = [p for p in landing if _covers(p, file_names, aliases)]  # and every module tensor is reached
    if len(full) == 1 or len(landing) == 1:
        prefix = (full or landing)[0]  # reaching only part of the module: the check lists the rest
        return NameMap({f: prefix + f for f in file_names}, prefix=prefix)
    if landing:
        shown = ", ".join(repr(p) for p in landing[:_SHOWN])
        raise ValueError(
            f"The names in {where} fit the module under several prefixes ({shown}): it holds several copies of the "
            f"model. Choose one with rename, e.g. rename={{'': {landing[0]!r}}}."
        )
    inside = sum(1 for f in file_names if f in model)
    best = max(sorted(fits.items()), key=lambda kv: (kv[1], -len(kv[0])), default=("", 0))
    if best[1] <= inside:  # the names mostly fit as they are: the file and model differ in a few names
        return NameMap({f: f for f in file_names})
    return NameMap({f: best[0] + f for f in file_names}, prefix=best[0])


def _prefix_votes(file_names: Collection[str], model: set[str]) -> dict[str, int]:
    """For each prefix ``P`` with ``P + f`` a module name for some file name ``f``: how many file
    names it fits. Indexed by the module names' dotted suffixes, so linear in the names."""
    prefixes_of: dict[str, list[str]] = {}
    for m in model:
        parts = m.split(".")
        for i in range(1, len(parts)):
            prefixes_of.setdefault(".".join(parts[i:]), []).append(".".join(parts[:i]) + ".")
    votes: dict[str, int] = {}
    for f in file_names:
        for p in set(prefixes_of.get(f, ())):
            votes[p] = votes.get(p, 0) + 1
    return votes


def _covers(prefix: str, file_names: Collection[str], aliases: Mapping[str, list[str]]) -> bool:
    present = {prefix + f for f in file_names}
    return all(any(a in present for a in group) for group in aliases.values())


def mismatch_hint(names: NameMap, file_names: Collection[str], model_names: Collection[str]) -> str:
    """The sentence an error about names that do not fit ends with: how they were matched,
    examples of both sides, and how to map them."""
    if names.renamed:
        how = "The file's names were mapped by rename. "
    elif names.prefix:
        how = f"The file's names were read with the prefix {names.prefix!r} added (found by matching the names). "
    else:
        how = ""
    files = ", ".join(repr(n) for n in sorted(file_names)[:2])
    models = ", ".join(repr(n) for n in sorted(model_names)[:2])
    return (
        f"{how}Names are those of the unsplit LightningModule's state_dict (the file has {files}, ...; the module "
        f"{models}, ...). A file whose names differ from the module's by one prefix (the model's attribute, e.g. "
        "'model.') is matched automatically; map other layouts with rename (a mapping of name prefixes, or a "
        "callable file_name -> module_name)."
    )
