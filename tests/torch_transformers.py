"""torch's own transformer (``nn.TransformerEncoder``, ``nn.TransformerDecoder``, ``nn.Transformer``) in
LightningModules as users write them, each with padding masks and a causal mask, and their data.

Every model's loss is a mean over samples of each sample's mean over its valid tokens, so that
micro-batches weighted by their samples add up to the whole batch's loss (a token mean over the batch
would weight the micro-batches by their tokens instead)."""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

WIDTH, HEADS, FEEDFORWARD, VOCAB, LENGTH = 16, 2, 32, 24, 8

Batch = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # source, its lengths, target, its lengths, labels


def padding(lengths: Tensor, length: int = LENGTH) -> Tensor:
    """The key padding mask of sequences of ``lengths`` (True at padding, on the right)."""
    return torch.arange(length).unsqueeze(0) >= lengths.unsqueeze(1)


def causal(length: int = LENGTH) -> Tensor:
    return nn.Transformer.generate_square_subsequent_mask(length)


def sample_mean(logits: Tensor, labels: Tensor, pad: Tensor) -> Tensor:
    """Each sample's mean cross-entropy over its valid tokens, averaged over the samples."""
    losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    valid = (~pad).float()
    return ((losses * valid).sum(1) / valid.sum(1)).mean()


class TorchTransformerNet(L.LightningModule):
    """Token predictions from torch's transformer: ``kind`` ``"encoder"`` (an ``nn.TransformerEncoder``
    over the source, with its ``norm=``; ``causal``: also a causal mask), ``"decoder"`` (an
    ``nn.TransformerDecoder`` over the target attending to the source through a one-layer encoder, with a
    causal target mask, a memory mask and both padding masks) or ``"transformer"`` (``nn.Transformer``,
    its masks alike). Validation logs the loss; prediction returns every position's logits, padding
    included (where torch's fast path gives other values than its plain path)."""

    def __init__(
        self,
        kind: Literal["encoder", "decoder", "transformer"] = "encoder",
        layers: int = 4,
        causal: bool = False,
        nested: bool = True,
        norm: bool = True,
        lr: float = 0.1,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.causal, self.lr = kind, causal, lr
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        options: dict[str, Any] = dict(dim_feedforward=FEEDFORWARD, dropout=0.0, batch_first=True)
        if kind == "encoder":
            layer = nn.TransformerEncoderLayer(WIDTH, HEADS, **options)
            final = nn.LayerNorm(WIDTH) if norm else None
            self.encoder = nn.TransformerEncoder(layer, layers, norm=final, enable_nested_tensor=nested)
        elif kind == "decoder":
            self.memory = nn.TransformerEncoder(nn.TransformerEncoderLayer(WIDTH, HEADS, **options), 1)
            layer = nn.TransformerDecoderLayer(WIDTH, HEADS, **options)
            self.decoder = nn.TransformerDecoder(layer, layers, norm=nn.LayerNorm(WIDTH) if norm else None)
        else:
            self.transformer = nn.Transformer(WIDTH, HEADS, layers, layers, **options)

    def forward(self, source: Tensor, source_lengths: Tensor, target: Tensor, target_lengths: Tensor) -> Tensor:
        src_pad, tgt_pad = padding(source_lengths), padding(target_lengths)
        if self.kind == "encoder":
            mask = causal() if self.causal else None
            hidden = self.encoder(self.embed(source), mask=mask, src_key_padding_mask=src_pad, is_causal=self.causal)
            return self.head(hidden)
        memory_mask = causal()  # target position t reads the source up to t (position 0 always)
        if self.kind == "decoder":
            memory = self.memory(self.embed(source), src_key_padding_mask=src_pad)
            hidden = self.decoder(
                self.embed(target),
                memory,
                tgt_mask=causal(),
                memory_mask=memory_mask,
                tgt_key_padding_mask=tgt_pad,
                memory_key_padding_mask=src_pad,
                tgt_is_causal=True,
            )
            return self.head(hidden)
        hidden = self.transformer(
            self.embed(source),
            self.embed(target),
            tgt_mask=causal(),
            memory_mask=memory_mask,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return self.head(hidden)

    def loss(self, batch: Batch) -> Tensor:
        source, source_lengths, target, target_lengths, labels = batch
        pad = padding(source_lengths if self.kind == "encoder" else target_lengths)
        return sample_mean(self(source, source_lengths, target, target_lengths), labels, pad)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return self.loss(batch)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def predict_step(self, batch: Batch, batch_idx: int) -> Tensor:
        source, source_lengths, target, target_lengths, _ = batch
        return self(source, source_lengths, target, target_lengths)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


#: where each kind's pipelined layers are, as ``PipelineStrategy(module=...)`` names them
MODULES = {
    "encoder": "encoder.layers",
    "decoder": "decoder.layers",
    "transformer encoder": "transformer.encoder.layers",
    "transformer decoder": "transformer.decoder.layers",
}


def transformer_data(n: int = 32, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """Source and target token sequences of ``LENGTH`` with 2 to ``LENGTH`` valid tokens each (the rest
    padding, with token 0), and a label per target position."""
    g = torch.Generator().manual_seed(seed)
    source_lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
    target_lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
    source = torch.randint(1, VOCAB, (n, LENGTH), generator=g).masked_fill(padding(source_lengths), 0)
    target = torch.randint(1, VOCAB, (n, LENGTH), generator=g).masked_fill(padding(target_lengths), 0)
    labels = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    return DataLoader(
        TensorDataset(source, source_lengths, target, target_lengths, labels), batch_size=batch_size, shuffle=False
    )
