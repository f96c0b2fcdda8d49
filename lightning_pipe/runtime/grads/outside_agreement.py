"""Every stage of a pipeline sums the gradients of the parameters outside the split layers in one
collective per step (:mod:`lightning_pipe.runtime.grads.gradients`), which works only while every stage
lists the same parameters in the same order. A stage that lists one more (a parameter of another
stage's layer reachable through a second name, classified by name instead of identity) makes
gloo abort the process on a size mismatch (``op.preamble.length <= op.nbytes``) or NCCL hang, with
nothing that names the parameter. So at setup the stages compare the names, shapes and dtypes of
those parameters once, in one small all-gather, and refuse with the difference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

#: (name, shape, dtype) of each parameter outside the split layers, in the order they are summed
Signature = list[tuple[str, tuple[int, ...], str]]


def signature(model: nn.Module, shared: Sequence[nn.Parameter]) -> Signature:
    """What this stage sums over the stages each step, by the first name ``model`` gives each tensor."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return [(names.get(id(p), "<unnamed>"), tuple(p.shape), str(p.dtype).removeprefix("torch.")) for p in shared]


def disagreement(signatures: Sequence[Signature]) -> str | None:
    """None when every stage lists the same parameters; otherwise what each stage lists that the
    first does not, and the reverse, as the message of the refusal."""
    first = signatures[0]
    if all(s == first for s in signatures):
        return None
    seen = {entry[0]: entry for entry in first}
    parts = []
    for stage, sig in enumerate(signatures[1:], start=1):
        if sig == first:
            continue
        here = {entry[0]: entry for entry in sig}
        extra = [f"{n} {list(e[1])} {e[2]}" for n, e in here.items() if seen.get(n) != e]
        missing = [f"{n} {list(e[1])} {e[2]}" for n, e in seen.items() if here.get(n) != e]
        if not extra and not missing:
            parts.append(f"stage {stage} lists the same parameters as stage 0 in another order")
            continue
        if extra:
            parts.append(f"stage {stage} has {', '.join(extra[:4])} that stage 0 does not")
        if missing:
            parts.append(f"stage 0 has {', '.join(missing[:4])} that stage {stage} does not")
    return (
        "The pipeline's stages disagree on the parameters outside the split layers, whose gradients they sum over "
        f"the stages every step: {'; '.join(parts)}. Every stage must hold the same parameters outside the layers "
        "that PipelineStrategy(module=...) names; a parameter that also belongs to a layer (one tensor under two "
        "names, such as a head's bias) is that layer's. Reach such a tensor through the layer, or put the module "
        "that holds it into the split layers."
    )


def check_outside_agreement(
    model: nn.Module, shared: Sequence[nn.Parameter], group: ProcessGroup, num_stages: int
) -> None:
    """Refuse, on every stage at once, before the first step, when the stages of ``group`` (a
    pipeline, its ranks in stage order) would sum different parameters (see the module docstring)."""
    if num_stages == 1:
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, signature(model, shared), group=group)
    message = disagreement(gathered)
    if message is not None:
        raise RuntimeError(message)
