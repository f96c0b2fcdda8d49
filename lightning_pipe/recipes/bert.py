"""BERT masked-language-model pre-training as pipeline layers, with a real English corpus offline.

The model is one ``nn.Sequential``: embeddings, ``num_layers`` encoder layers and the MLM head.
Layers pass ``(hidden, attention_mask)`` along, or ``(hidden, attention_mask, predicted)`` with the
positions the head predicts (the masked tokens, in training: the head's vocabulary-wide product is
most of the model's work, and BERT's loss reads only those positions); the masks need no gradient. As in BERT, the MLM
head's decoder weight is the word-embedding matrix (``tie_embeddings``); under the pipeline the
first and the last stage each hold a copy and the strategy sums their gradients, so the copies stay
equal.

Text: the Python standard library's docstrings or the user's files, with a word tokenizer built
locally from them (:mod:`lightning_pipe.recipes.text`).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from lightning_pipe.recipes import builds_in_configure_model
from lightning_pipe.recipes.text import MASK, PAD, SPECIALS, CorpusData
from lightning_pipe.recipes.warmup import warmup_then_decay
from lightning_pipe.runtime.loss_weights import token_count

SIZES = {
    "tiny": dict(hidden=128, num_layers=2, heads=2, intermediate=512),
    "small": dict(hidden=256, num_layers=4, heads=4, intermediate=1024),
    "base": dict(hidden=768, num_layers=12, heads=12, intermediate=3072),
    "large": dict(hidden=1024, num_layers=24, heads=16, intermediate=4096),
}


# ---------------------------------------------------------------------------- model
def _init_bert_weights(module: nn.Module) -> None:
    """BERT's initialisation: normal(0, 0.02) weights, zero biases. With PyTorch's default N(0, 1)
    embeddings, a decoder tied to them would start with logits of standard deviation ~sqrt(hidden)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        with torch.no_grad():
            module.weight[module.padding_idx].zero_()


class _BertInit:
    """``reset_parameters`` with BERT's initialisation, for a layer built on the meta device and
    initialised by the pipeline (which calls it after its children's own)."""

    def reset_parameters(self) -> None:
        self.apply(_init_bert_weights)  # type: ignore[attr-defined]


class Embeddings(_BertInit, nn.Module):
    def __init__(self, vocab_size: int, hidden: int, max_len: int, dropout: float) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab_size, hidden, padding_idx=PAD)
        self.position = nn.Embedding(max_len, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        ids, mask, *predicted = inputs
        positions = torch.arange(ids.shape[1], device=ids.device)
        hidden = self.dropout(self.norm(self.word(ids) + self.position(positions)))
        return hidden, mask, *predicted


class EncoderLayer(_BertInit, nn.Module):
    """A post-norm transformer encoder layer, as in BERT."""

    def __init__(self, hidden: int, heads: int, intermediate: int, dropout: float) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.norm1 = nn.LayerNorm(hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, intermediate), nn.GELU(), nn.Linear(intermediate, hidden))
        self.norm2 = nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, mask, *predicted = inputs
        attended, _ = self.attention(hidden, hidden, hidden, key_padding_mask=~mask, need_weights=False)
        hidden = self.norm1(hidden + self.dropout(attended))
        hidden = self.norm2(hidden + self.dropout(self.ffn(hidden)))
        return hidden, mask, *predicted


class MLMHead(_BertInit, nn.Module):
    def __init__(self, hidden: int, vocab_size: int) -> None:
        super().__init__()
        self.transform = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden))
        self.decoder = nn.Linear(hidden, vocab_size)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Logits ``(batch, length, vocab)``, or ``(n, vocab)`` for the ``n`` positions of ``predicted``."""
        hidden, _, *predicted = inputs
        if predicted:
            hidden = hidden[predicted[0]]
        return self.decoder(self.transform(hidden))


def bert_layers(
    vocab_size: int, size: str = "tiny", max_len: int = 128, dropout: float = 0.1, **overrides: int
) -> nn.Sequential:
    if size not in SIZES:
        raise ValueError(f"BERT size {size!r} is unknown; valid sizes: {', '.join(SIZES)}")
    dims = {**SIZES[size], **{k: v for k, v in overrides.items() if v is not None}}
    layers: list[nn.Module] = [Embeddings(vocab_size, dims["hidden"], max_len, dropout)]
    layers += [
        EncoderLayer(dims["hidden"], dims["heads"], dims["intermediate"], dropout) for _ in range(dims["num_layers"])
    ]
    layers.append(MLMHead(dims["hidden"], vocab_size))
    return nn.Sequential(*layers)


class BertMLM(L.LightningModule):
    """Masked-language-model pre-training; AdamW with linear warm-up and decay.

    ``build``: ``"eager"`` creates the layers in ``__init__``, ``"configure_model"`` in
    ``configure_model()``, ``"auto"`` (default) the latter above 100M parameters (``size=large``)."""

    def __init__(
        self,
        vocab_size: int = 8000,
        size: str = "tiny",
        max_len: int = 128,
        dropout: float = 0.1,
        lr: float = 5e-4,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        max_steps: int = 1000,
        hidden: int | None = None,
        num_layers: int | None = None,
        tie_embeddings: bool = True,
        build: str = "auto",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers: nn.Sequential | None = None
        if not builds_in_configure_model(build, self._bert_layers):
            self.configure_model()

    def _bert_layers(self) -> nn.Sequential:
        hp = self.hparams
        return bert_layers(hp.vocab_size, hp.size, hp.max_len, hp.dropout, hidden=hp.hidden, num_layers=hp.num_layers)

    def configure_model(self) -> None:
        """Create the layers (here for models above 100M parameters, see ``build``: under the
        pipeline they are then built on the meta device and each rank materialises its stage)."""
        if self.layers is not None:
            return
        layers = self._bert_layers()
        layers.apply(_init_bert_weights)  # nothing to do on the meta device; the pipeline calls reset_parameters
        if self.hparams.tie_embeddings:
            layers[-1].decoder.weight = layers[0].word.weight
        self.layers = layers

    @property
    def strategy_defaults(self) -> dict[str, Any]:
        """``PipelineStrategy`` arguments this model needs unless the run sets them: ``loss_weight``
        counts the masked tokens (labels other than -100, the third item of a batch) that the loss
        averages over, so that the pipeline trains on the batch's mean over them, as plain training
        does: micro-batches hold different numbers of masked tokens. ``balance`` by parameters: the
        embeddings, the encoder layers and the head differ in size."""
        return {"loss_weight": token_count(labels=2, shift=False), "balance": "parameters"}

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, predicted: torch.Tensor | None = None) -> torch.Tensor:
        """Logits at every position, or at the ``predicted`` ones only (a boolean mask of ``ids``' shape)."""
        return self.layers((ids, mask) if predicted is None else (ids, mask, predicted))

    def _loss(self, batch: Any) -> torch.Tensor:
        """Cross-entropy over the masked tokens (labels other than -100); the head predicts only those."""
        ids, mask, labels = batch
        predicted = labels != -100
        return F.cross_entropy(self(ids, mask, predicted), labels[predicted])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        # No sync_dist=True: under the pipeline every rank already logs the last stage's value, averaged over
        # the replicas, and Lightning drops sync_dist for a strategy that is not `is_distributed` (the
        # pipeline's, so that Lightning never swaps in its own sampler): its warning asking for it is moot.
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        schedule = warmup_then_decay(optimizer, hp.warmup_steps, hp.max_steps, "linear")
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


# ---------------------------------------------------------------------------- masking
class MaskedSequences(Dataset):
    """Rows of token ids with BERT's masking (15% of tokens: 80% [MASK], 10% random, 10% kept).

    The masking of a row depends only on the row and the epoch (``set_epoch``, called by the recipes'
    sampler), never on the process's random state or on what this process read before: every
    pipeline stage builds the same batch, and a run resumed from a checkpoint (``resume=``) masks as
    an uninterrupted run does. Validation rows (never given an epoch) keep one masking.
    """

    def __init__(self, rows: torch.Tensor, vocab_size: int, seed: int, probability: float = 0.15) -> None:
        self.rows, self.vocab_size, self.seed, self.probability = rows, vocab_size, seed, probability
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index * 7_919 + self.epoch)
        ids = self.rows[index].clone()
        special = ids < len(SPECIALS)
        chosen = (torch.rand(ids.shape, generator=g) < self.probability) & ~special
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        roll = torch.rand(ids.shape, generator=g)
        ids[chosen & (roll < 0.8)] = MASK
        random_tokens = torch.randint(len(SPECIALS), self.vocab_size, ids.shape, generator=g)
        swap = chosen & (roll >= 0.8) & (roll < 0.9)
        ids[swap] = random_tokens[swap]
        return ids, torch.ones_like(ids, dtype=torch.bool), labels


class TextData(CorpusData):
    """Rows of the corpus (see :mod:`lightning_pipe.recipes.text`) with BERT's masking."""

    def dataset(self, rows: torch.Tensor, seed: int) -> MaskedSequences:
        if self.tokenizer_dir:
            raise ValueError("recipe.data.tokenizer: bert_mlm masks with its own word tokenizer; leave it unset.")
        return MaskedSequences(rows, self.vocab_size, seed)
