"""What a model's own loss averages over, read from the model and the batch, so that the defaults fit it.

- **Token means, decided.** A Hugging Face model whose loss (``labels=``) is a mean over the labels other
  than -100 (``*ForCausalLM`` and decoder-only ``*ForConditionalGeneration``, which shift the labels;
  ``*ForMaskedLM``, ``*ForTokenClassification`` and encoder-decoder ``*ForConditionalGeneration``, which do
  not: transformers' own auto-class groups say which), fed a mapping batch with ``"labels"`` (the Hugging
  Face way: ``model(**batch)``): under the default ``loss_weight`` its micro-batches are weighted by those
  labels (:func:`default_loss_weight`), so the pipeline trains on the whole batch's token mean, as plain
  training does.
- **Token means, not decidable.** Elsewhere (a tuple batch, a user's own
  ``F.cross_entropy(..., ignore_index=-100)``, which may be a mean over tokens or not) the default stays the
  samples, and :func:`padding_warning` says so once, at the first batch whose micro-batches hold different
  shares of valid labels than of samples, naming the ``token_count`` that fixes it (rank 0 reads the labels
  back for it each training step until it has warned: one small read per step).
- **Per-forward auxiliary losses.** A mixture of experts' load-balancing loss
  (``output_router_logits=True``) is computed once per forward: under the pipeline once per micro-batch, as
  under gradient accumulation. :func:`per_forward_loss_line` says so once.

Pure: no Lightning, no torch.distributed; transformers is read only when it is imported already.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.runtime.loss_weights import TokenCount
from lightning_pipe.runtime.microbatch import batch_size

IGNORE_INDEX = -100  # Hugging Face's and torch's cross entropy's default ignore index

#: transformers' auto-class groups whose models' loss (``labels=``) averages over the labels other than -100 ->
#: whether it shifts the labels (a causal LM's first label is never a target); encoder-decoders never shift
TOKEN_MEAN_GROUPS = {
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": True,
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES": True,
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES": False,
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES": False,
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": False,
}


def hf_models(module: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face models inside ``module`` (empty without transformers imported)."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None)
    if base is None:
        return []
    found: list[nn.Module] = []
    inner: set[int] = set()
    for sub in module.modules():
        if id(sub) in inner or not isinstance(sub, base):
            continue
        found.append(sub)
        inner.update(id(m) for m in sub.modules())
    return found


def token_mean_shift(module: nn.Module) -> bool | None:
    """Whether the one Hugging Face model in ``module`` has a token-mean loss that shifts its labels (True),
    one that does not (False), or None: no such model, several, or another loss."""
    models = hf_models(module)
    if len(models) != 1:
        return None
    model = models[0]
    auto = importlib.import_module("transformers.models.auto.modeling_auto")  # imported with the model
    name = type(model).__name__
    groups = [shift for group, shift in TOKEN_MEAN_GROUPS.items() if name in getattr(auto, group, {}).values()]
    if not groups:
        return None
    return groups[0] and not getattr(getattr(model, "config", None), "is_encoder_decoder", False)


def default_loss_weight(shift: bool | None, batch: Any) -> TokenCount | None:
    """The default ``loss_weight`` for ``batch``: its valid labels where the model's loss is a token mean
    (``shift`` from :func:`token_mean_shift`) and the batch a mapping with integer ``"labels"``; else None
    (the samples). Decided from the batch's structure, so every stage and replica decides the same."""
    if shift is None or not isinstance(batch, Mapping):
        return None
    labels = batch.get("labels")
    if not isinstance(labels, Tensor) or labels.is_floating_point() or labels.dim() == 0:
        return None
    return TokenCount("labels", IGNORE_INDEX, shift)


def labels_key(batch: Any) -> tuple[str | int | None] | None:
    """Where ``batch`` keeps labels with an ignore index, as ``token_count``'s ``labels=`` names it (in a
    1-tuple; None: not found): a mapping's ``"labels"``, or the one integer tensor of a tuple batch (or the
    batch itself) that holds -100 (token ids and masks never do)."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        return ("labels",) if isinstance(labels, Tensor) and not labels.is_floating_point() else None
    candidates: list[tuple[int | None, Tensor]]
    if isinstance(batch, Tensor):
        candidates = [(None, batch)]
    elif isinstance(batch, Sequence) and not isinstance(batch, str):
        candidates = [(i, t) for i, t in enumerate(batch) if isinstance(t, Tensor)]
    else:
        return None
    candidates = [(k, t) for k, t in candidates if t.dim() > 0 and not t.is_floating_point() and t.dtype != torch.bool]
    if not candidates:
        return None
    holds = torch.stack([(t == IGNORE_INDEX).any() for _, t in candidates]).tolist()  # one read back
    found = [k for (k, _), has in zip(candidates, holds) if has]
    return (found[0],) if len(found) == 1 else None


def padding_warning(batch: Any, micro: Sequence[Any]) -> str | None:
    """The warning for ``batch``'s micro-batches, weighted by their samples, whose labels leave out
    positions with -100 in other shares than their samples (a loss that is a token mean then trains on
    another mean than plain training's), or None where the shares agree or no such labels are found."""
    if len(micro) < 2:
        return None
    key = labels_key(batch)
    if key is None:
        return None
    count = TokenCount(key[0], IGNORE_INDEX, shift=False)
    counts = torch.stack([count(mb) for mb in micro]).tolist()
    sizes = [batch_size(mb) for mb in micro]
    if all(c * sum(sizes) == s * sum(counts) for c, s in zip(counts, sizes)):
        return None
    return (
        f"The batch's labels leave out positions with -100 (padding, unmasked tokens), and its micro-batches hold "
        f"other shares of valid labels ({counts}) than of samples ({sizes}). By default each micro-batch's loss "
        "is weighted by its samples, so a loss that is a mean over the valid tokens (Hugging Face's with a tuple "
        "batch, F.cross_entropy(..., ignore_index=-100)) trains on another mean than plain training's token mean "
        "over the whole batch. Give PipelineStrategy(loss_weight=lightning_pipe.token_count(labels="
        f"{key[0]!r})) (shift=False where the loss does not shift the labels itself, as a causal LM's does), or "
        "loss_weight='samples' where the loss is a mean over samples (this warning then goes)."
    )


def per_forward_loss_line(module: nn.Module) -> str | None:
    """The line telling that a Hugging Face mixture of experts' load-balancing loss is computed per
    micro-batch (None where no model in ``module`` adds one)."""
    for model in hf_models(module):
        config = getattr(model, "config", None)
        coefficient = getattr(config, "router_aux_loss_coef", 0.0)
        if getattr(config, "output_router_logits", False) and coefficient:
            return (
                f"{type(model).__name__} adds a load-balancing loss (output_router_logits=True, router_aux_loss_coef="
                f"{coefficient}), which is computed once per forward: under the pipeline once per micro-batch, as "
                "under gradient accumulation, so it differs slightly from one computed over the whole batch at once "
                "(the language-model loss does not)."
            )
    return None
