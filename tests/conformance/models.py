"""The model axis's models and their data: each trains, validates, tests and predicts, and its data
repeats one batch of 12 samples, so that plain Lightning resumes exactly even in the middle of an
epoch (it replays an epoch's batches from the start)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import parameter_penalty, token_count
from tests.conformance.axes import Model
from tests.models import CLASSES, HIDDEN, IN, PopA, PopB, StashA, StashB, dataset

BATCH, REPEATS, VOCAB, LENGTH = 12, 3, 11, 4


class _Steps(L.LightningModule):
    """Loss, validation, test and predict from ``self(x)`` and ``self.loss``; Adam, AdamW with weight decay, or
    plain SGD (``optimizer="sgd"``: its step is the gradient's scale, which Adam hides); an optional StepLR
    stepping every step."""

    def __init__(
        self,
        lr: float = 0.01,
        weight_decay: float = 0.0,
        scheduler: bool = False,
        eps: float = 1e-8,
        optimizer: str = "adam",
    ) -> None:
        super().__init__()
        self.lr, self.weight_decay, self.scheduler, self.eps = lr, weight_decay, scheduler, eps
        self.optimizer = optimizer

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)  # the replicas' mean, as plain training's whole batch
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=20 * self.lr)
        elif self.weight_decay:
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        else:
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr, eps=self.eps)
        if not self.scheduler:
            return optimizer
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class SequentialNet(_Steps):
    """Seven blocks and a head; ``dropout``: blocks 1, 4 and 5 drop (one on the first of 2 stages, two on the
    second; 1, 2 and 0 on 3 stages), so that the ranks' random states differ."""

    DROPS = (1, 4, 5)

    def __init__(self, dropout: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        blocks = [
            nn.Sequential(
                nn.Linear(IN if i == 0 else HIDDEN, HIDDEN),
                nn.Tanh(),
                *([nn.Dropout(0.25)] if dropout and i in self.DROPS else []),
            )
            for i in range(7)
        ]
        self.layers = nn.Sequential(*blocks, nn.Linear(HIDDEN, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class SkipsNet(_Steps):
    """A U-Net-shaped ``nn.Sequential`` whose layers stash and pop two skip connections across stages
    (``lightning_pipe.skips``): layer 0 stashes for the last layer, layer 1 for layer 3."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layers = nn.Sequential(
            StashA(), StashB(), nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()), PopB(),
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()), PopA(),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class RecordsNet(_Steps):
    """A tiny BERT classifying from the mean of its last 4 layers' [CLS] hidden states
    (``output_hidden_states``: transformers records every block's output with hooks, so the values of
    other stages' blocks cross with the micro-batch), split with ``module="bert.encoder.layer"``."""

    def __init__(self, **kwargs: Any) -> None:
        import transformers

        # Adam's eps: the attention's key and query biases get gradients of 1e-6 and below (a key's bias
        # cancels in the softmax: float noise), which the default 1e-8 scales up to whole steps, noise included
        super().__init__(eps=1e-4, **kwargs)
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=6,
                                         num_attention_heads=2, intermediate_size=2 * HIDDEN,
                                         max_position_embeddings=LENGTH, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)  # fmt: skip
        self.bert = transformers.BertModel(config, add_pooling_layer=False)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=ids, output_hidden_states=True).hidden_states
        return self.head(torch.stack([h[:, 0] for h in hidden[-4:]]).mean(0))


class BlocksNet(_Steps):
    """A forward that loops over an ``nn.ModuleList`` (split with ``module="blocks"``), with an input
    projection, a norm and a head outside it; ``frozen``: the norm is frozen and AdamW decays."""

    def __init__(self, frozen: bool = False, **kwargs: Any) -> None:
        super().__init__(weight_decay=0.1 if frozen else 0.0, **kwargs)
        self.embed = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(6)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)
        if frozen:
            with torch.no_grad():
                self.norm.weight.uniform_(0.5, 1.5)
            self.norm.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.norm(hidden))


class OutsideNet(_Steps):
    """Trainable parameters outside the split ``nn.Sequential`` on both ends."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embed = nn.Linear(IN, HIDDEN)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(6)])
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.tanh(self.embed(x))))


class TokenNet(_Steps):
    """Tokens in, a logit per token out; ``tied``: the head's weight is the embedding's. Labels of
    -100 are left out of the loss (the token mean)."""

    def __init__(self, tied: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        embed = nn.Embedding(VOCAB, HIDDEN)
        head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            head.weight = embed.weight
        middle = [m for _ in range(3) for m in (nn.Linear(HIDDEN, HIDDEN), nn.Tanh())]
        self.layers = nn.Sequential(embed, nn.Tanh(), *middle, head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layers(ids)

    def loss(self, batch: Any) -> torch.Tensor:
        ids, labels = batch
        return F.cross_entropy(self(ids).reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


class AroundNet(SequentialNet):
    """The Sequential as a user writes code around it: ``forward`` loops over its layers, ``configure_optimizers``
    gives each layer a learning rate by its position and adds an L2 penalty over every parameter (each stage its
    own parameters' part: ``lightning_pipe.parameter_penalty``), plain SGD."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def configure_optimizers(self) -> Any:
        groups = [{"params": list(layer.parameters()), "lr": 0.4 / (1 + i)} for i, layer in enumerate(self.layers)]
        optimizer = parameter_penalty(torch.optim.SGD(groups, lr=0.1), lambda p: 1e-2 * (p**2).sum())
        if not self.scheduler:
            return optimizer
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class TorchEncoderNet(_Steps):
    """torch's own ``nn.TransformerEncoder`` of 6 layers (as many as the layouts' most stages) with its
    final norm, over token ids whose 0s are padding (its ``src_key_padding_mask``), classifying each
    sequence from the mean of its valid positions; split with ``module="encoder.layers"``. Evaluation
    (prediction, test) takes torch's fast path: nested tensors, zeros at the padding."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(eps=1e-4, **kwargs)  # Adam's eps: the attention's key bias gets float noise (RecordsNet)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, 2, 2 * HIDDEN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 6, norm=nn.LayerNorm(HIDDEN))
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        padding = ids == 0
        hidden = self.encoder(self.embed(ids), src_key_padding_mask=padding)
        valid = (~padding).unsqueeze(-1).float()
        return self.head((hidden * valid).sum(1) / valid.sum(1))


def build(model: Model, scheduler: bool = False) -> L.LightningModule:
    """A fresh ``model`` (its initial weights come from the caller's seed)."""
    if model.torch_transformer:
        return TorchEncoderNet(scheduler=scheduler)
    if model.records:
        return RecordsNet(scheduler=scheduler)
    if model.module is not None:
        return BlocksNet(frozen=model.name == "frozen", scheduler=scheduler)
    if model.outside:
        return OutsideNet(scheduler=scheduler)
    if model.skips:
        return SkipsNet(scheduler=scheduler)
    if model.tied or model.token_count:
        return TokenNet(tied=model.tied, scheduler=scheduler)
    if model.around:
        return AroundNet(scheduler=scheduler)
    return SequentialNet(dropout=model.dropout, optimizer=model.optimizer, scheduler=scheduler)


def strategy_options(model: Model) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if model.module is not None:
        options["module"] = model.module
    if model.token_count:
        options["loss_weight"] = token_count(labels=1, shift=False)
    return options


def data(model: Model, batch_size: int = BATCH, shuffle: bool = False) -> DataLoader:
    """``REPEATS`` copies of one batch of 12 samples, in batches of ``batch_size`` (a replica's share).
    The token models' rows 0-5 of the 12 have no label (-100): the first micro-batch of every split
    the layouts make has no token; rows 6 and 7 miss one each, so micro-batches differ in tokens
    while two replicas (even and odd rows) hold the same number, as their averaged token means
    (DDP's rule, see docs/usage.md) equal plain training's only then."""
    if model.tied or model.token_count:
        g = torch.Generator().manual_seed(4)
        ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
        labels = (ids * 3 + 1) % VOCAB
        if model.token_count:  # replicas (even and odd rows) keep as many tokens each: their means' mean is plain's
            labels[: BATCH // 2] = -100
            labels[BATCH // 2 : BATCH // 2 + 2, 0] = -100
        tensors = (ids, labels)
    elif model.records:  # token sequences and a class each
        ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(5))
        tensors = (ids, ids.sum(1) % CLASSES)
    elif model.torch_transformer:  # token sequences of 1 to LENGTH tokens, padded with 0 on the right
        g = torch.Generator().manual_seed(6)
        ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=g)
        lengths = torch.arange(BATCH) % LENGTH + 1
        ids = ids.masked_fill(torch.arange(LENGTH) >= lengths.unsqueeze(1), 0)
        tensors = (ids, ids.sum(1) % CLASSES)
    else:
        tensors = dataset(BATCH, seed=0).tensors
    repeated = TensorDataset(*(t.repeat(REPEATS, *[1] * (t.dim() - 1)) for t in tensors))
    return DataLoader(repeated, batch_size=batch_size, shuffle=shuffle)
