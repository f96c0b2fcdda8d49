"""Tiny models and data shared by the tests (importable by spawned processes)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe.skips import pop, skippable, stash

IN, HIDDEN, CLASSES = 6, 8, 3


def make_layers(depth: int = 8, dropout: float = 0.0) -> nn.Sequential:
    """``depth`` layers: Linear/Tanh pairs (a Dropout among them when asked), ending in a Linear."""
    layers: list[nn.Module] = [nn.Linear(IN, HIDDEN)]
    while len(layers) < depth - 1:
        layers.append(nn.Tanh() if dropout == 0.0 or len(layers) % 4 != 1 else nn.Dropout(dropout))
        if len(layers) < depth - 1:
            layers.append(nn.Linear(HIDDEN, HIDDEN))
    layers.append(nn.Linear(HIDDEN, CLASSES))
    return nn.Sequential(*layers)


class TinyNet(L.LightningModule):
    """An ordinary LightningModule: nothing in it knows about the pipeline."""

    def __init__(self, depth: int = 8, lr: float = 0.1, dropout: float = 0.0, optimizer: str = "sgd") -> None:
        super().__init__()
        self.layers = make_layers(depth, dropout)
        self.lr = lr
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        if self.optimizer == "plain-sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def dataset(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return TensorDataset(x, y)


def loader(n: int = 64, batch_size: int = 12, seed: int = 0) -> DataLoader:
    return DataLoader(dataset(n, seed), batch_size=batch_size, shuffle=False)


def trainer_kwargs(max_steps: int = 6, **extra: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        max_steps=max_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    kwargs.update(extra)
    return kwargs


def plain_trainer(**extra: Any) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, **trainer_kwargs(**extra))


def fit_plain(
    model: L.LightningModule,
    data: DataLoader | None = None,
    val_data: DataLoader | None = None,
    ckpt_path: str | None = None,
    **extra: Any,
) -> L.Trainer:
    trainer = plain_trainer(**extra)
    trainer.fit(model, data if data is not None else loader(), val_data, ckpt_path=ckpt_path)
    return trainer


class RecordMetrics(L.Callback):
    """Writes each rank's ``callback_metrics`` at the end of training to ``<folder>/rank<k>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import json
        import os

        values = {k: float(v) for k, v in trainer.callback_metrics.items()}
        with open(os.path.join(self.folder, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(values, f)


class WrappedNet(L.LightningModule):
    """Parameters outside the split Sequential on both ends: an input projection and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.tanh(self.embed(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class MaskedBlock(nn.Module):
    """Takes and returns ``(x, mask)``: a tuple activation whose mask needs no gradient."""

    def __init__(self, last: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.last = last

    def forward(self, inputs: Any) -> Any:
        x, mask = inputs
        x = torch.tanh(self.linear(x)) * mask.unsqueeze(-1)
        return x.sum(1) if self.last else (x, mask)


class MaskedNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, HIDDEN)
        self.layers = nn.Sequential(
            *[MaskedBlock() for _ in range(3)], MaskedBlock(last=True), nn.Linear(HIDDEN, CLASSES)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.layers((self.proj(x), mask))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, mask, y = batch
        loss = F.cross_entropy(self(x, mask), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def masked_loader(n: int = 40, tokens: int = 5, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, tokens, IN, generator=g)
    mask = torch.rand(n, tokens, generator=g) > 0.3
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return DataLoader(TensorDataset(x, mask, y), batch_size=batch_size)


def variable_length_loader(n: int = 36, batch_size: int = 8) -> DataLoader:
    """Sequences of 2 to 7 tokens, padded per batch: activation shapes change from batch to batch."""
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(2, 8, (n,), generator=g).tolist()
    items = [(torch.randn(k, IN, generator=g), int(torch.randint(0, CLASSES, (), generator=g))) for k in lengths]

    def collate(batch: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        longest = max(x.shape[0] for x, _ in batch)
        x = torch.zeros(len(batch), longest, IN)
        mask = torch.zeros(len(batch), longest, dtype=torch.bool)
        for i, (seq, _) in enumerate(batch):
            x[i, : len(seq)] = seq
            mask[i, : len(seq)] = True
        return x, mask, torch.tensor([label for _, label in batch])

    return DataLoader(items, batch_size=batch_size, collate_fn=collate)


class LifecycleNet(TinyNet):
    """TinyNet with validation, test and predict steps, Adam and (optionally) a learning-rate schedule."""

    def __init__(self, scheduler: bool = False, **kwargs: Any) -> None:
        super().__init__(optimizer="adam", lr=0.01, **kwargs)
        self.scheduler = scheduler

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        x, _ = batch
        return self(x).softmax(-1)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return optimizer
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ScheduledNet(TinyNet):
    """TinyNet whose optimizer (``optimizer``: as TinyNet's) steps with a per-step learning-rate schedule;
    with a validation step."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=6, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class RecordWarnings(L.Callback):
    """Writes the warnings each rank raised during training to ``<folder>/warnings<k>.json`` (a
    spawned or forked rank's warnings reach no output the test can read otherwise)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._catching: Any = None
        self._caught: list = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import warnings

        self._catching = warnings.catch_warnings(record=True)
        self._caught = self._catching.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import json
        import os

        self._catching.__exit__(None, None, None)
        with open(os.path.join(self.folder, f"warnings{trainer.global_rank}.json"), "w") as f:
            json.dump([str(w.message) for w in self._caught], f)


class RecordEpochs(L.Callback):
    """Writes each rank's last epoch and (when present) gradient-scaler scale to ``<folder>/end<k>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import json
        import os

        scaler = getattr(trainer.precision_plugin, "scaler", None)
        values = {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "should_stop": trainer.should_stop,
            "scale": float(scaler.get_scale()) if scaler is not None else None,
        }
        with open(os.path.join(self.folder, f"end{trainer.global_rank}.json"), "w") as f:
            json.dump(values, f)


class TraceVersions(L.Callback):
    """Records which weight version each forward and backward used, per rank, to ``<folder>/trace<k>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.trace: list | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.trace = trainer.strategy.pipeline.runner.enable_trace()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import json
        import os

        versions = trainer.strategy.pipeline.runner.versions
        with open(os.path.join(self.folder, f"trace{trainer.global_rank}.json"), "w") as f:
            json.dump({"trace": self.trace, "peak_bytes": versions.peak_bytes if versions else 0}, f)


def separable_loader(n: int = 96, batch_size: int = 16) -> DataLoader:
    """A learnable task: the label is the arg-max of a fixed linear map of the input."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, IN, generator=g)
    y = (x @ torch.randn(IN, CLASSES, generator=g)).argmax(-1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class EpochLossNet(TinyNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss


class TiedNet(L.LightningModule):
    """A language-model shape: the output layer's weight is the input embedding's (one tensor)."""

    VOCAB, WIDTH, LENGTH = 11, 8, 5

    def __init__(self) -> None:
        super().__init__()
        embed = nn.Embedding(self.VOCAB, self.WIDTH)
        head = nn.Linear(self.WIDTH, self.VOCAB, bias=False)
        head.weight = embed.weight
        self.layers = nn.Sequential(embed, nn.Tanh(), nn.Linear(self.WIDTH, self.WIDTH), nn.Tanh(), head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layers(ids)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        logits = self(ids)
        loss = F.cross_entropy(logits.reshape(-1, self.VOCAB), targets.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class FrozenTieNet(TiedNet):
    """:class:`TiedNet` with its tied embedding frozen (a weight tied across the first and the last
    stage), every parameter given to AdamW with weight decay."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[0].weight.requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


def token_loader(n: int = 48, batch_size: int = 12) -> DataLoader:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, TiedNet.VOCAB, (n, TiedNet.LENGTH), generator=g)
    return DataLoader(TensorDataset(ids, (ids + 1) % TiedNet.VOCAB), batch_size=batch_size)


class MetricNet(TinyNet):
    """Logs a torchmetrics object, updated by every micro-batch: the samples seen in the epoch."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.seen = torchmetrics.SumMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _y = batch
        self.seen.update(torch.tensor(float(len(x))))
        self.log("seen", self.seen, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


class _Wait(torch.autograd.Function):
    """Identity that waits ``seconds`` in the forward and twice that in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        import time

        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import time

        time.sleep(2 * ctx.seconds)
        return grad, None


class WaitingLayer(nn.Module):
    """A Linear layer whose forward and backward also take ``units`` x 0.5 ms per call: layers with
    the same parameters and different costs. The cost is waiting, like a kernel on an accelerator
    while the CPU is free, so that two stages overlap on a shared 2-core machine as they would on
    two devices."""

    def __init__(self, units: float, width: int = HIDDEN) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.units = units

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Wait.apply(torch.tanh(self.linear(x)), self.units * 5e-4)


class SkewedNet(TinyNet):
    """Layers of equal parameter counts whose costs differ ``heavy``-fold: the first six are heavy."""

    def __init__(self, heavy: float = 4.0, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        units = [heavy] * 6 + [1.0] * 6
        self.layers = nn.Sequential(
            nn.Linear(IN, HIDDEN), *[WaitingLayer(u) for u in units], nn.Linear(HIDDEN, CLASSES)
        )


class RecordSplit(L.Callback):
    """Writes each rank's split, profile, placement (the layout's rank order and the rank's position)
    and training step times (``on_train_batch_*``) to ``<folder>/rank<k>.pt``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        import time

        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        import time

        self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import os

        strategy = trainer.strategy
        record = {"balance": strategy.stage_balance, "profile": strategy.profile, "times": self.times}
        record["plan"] = strategy.plan_candidates
        record["resources"] = strategy.rank_resources
        record["chunks"], record["schedule"] = strategy.chunks, strategy.schedule_name
        record["order"], record["position"] = strategy.layout.order, strategy.stage
        torch.save(record, os.path.join(self.folder, f"rank{trainer.global_rank}.pt"))


class DeferredNet(TinyNet):
    """TinyNet whose layers are created in ``configure_model()``, as a model too big for one process
    would create them (the pipeline builds them on the meta device)."""

    def __init__(self, depth: int = 8, lr: float = 0.1, width: int = HIDDEN) -> None:
        L.LightningModule.__init__(self)
        self.depth, self.lr, self.optimizer, self.width = depth, lr, "sgd", width
        self.layers: nn.Sequential | None = None

    def configure_model(self) -> None:
        if self.layers is not None:  # Lightning calls it again for each trainer.fit/validate/test
            return
        layers: list[nn.Module] = [nn.Linear(IN, self.width)]
        while len(layers) < self.depth - 1:
            layers += [nn.Tanh(), nn.Linear(self.width, self.width)][: self.depth - 1 - len(layers)]
        self.layers = nn.Sequential(*layers, nn.Linear(self.width, CLASSES))


class SaveStageState(L.Callback):
    """Each rank writes its module's real (non-meta) tensors at ``on_fit_start`` (``start=True``)
    or ``on_train_end`` to ``<folder>/<when>-rank<k>.pt``; :func:`merged_stage_states` joins them."""

    def __init__(self, folder: str, start: bool = False) -> None:
        self.folder, self.start = folder, start

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import os

        state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items() if not v.is_meta}
        when = "start" if self.start else "end"
        torch.save(state, os.path.join(self.folder, f"{when}-rank{trainer.global_rank}.pt"))

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.start:
            self._save(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.start:
            self._save(trainer, pl_module)


def merged_stage_states(folder: str, ranks: int, start: bool = False) -> dict[str, torch.Tensor]:
    import os

    merged: dict[str, torch.Tensor] = {}
    for rank in range(ranks):
        merged.update(
            torch.load(os.path.join(folder, f"{'start' if start else 'end'}-rank{rank}.pt"), weights_only=True)
        )
    return merged


class ReadsBlocksNet(L.LightningModule):
    """A model whose forward loops over an ``nn.ModuleList`` and whose steps read blocks' outputs
    after the loop. Training, by ``reads``: ``"pool"`` every block's output averaged, ``"probe"`` a
    probe loss on block 1's, ``"statistic"`` the loss scaled by a detached statistic of block 0's,
    ``"logged"`` a probe on block 0's output logged only. Validation and prediction pool every
    block's output."""

    def __init__(self, reads: str, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(depth)])
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.probe = nn.Linear(HIDDEN, CLASSES)
        self.reads = reads

    def _run(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        hidden = self.embed(x)
        outputs = []
        for block in self.blocks:
            hidden = block(hidden)
            outputs.append(hidden)
        return hidden, outputs

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden, outputs = self._run(x)
        loss = F.cross_entropy(self.head(hidden), y)
        if self.reads == "pool":
            return F.cross_entropy(self.head(torch.stack(outputs).mean(0)), y)
        if self.reads == "statistic":
            return loss * outputs[0].detach().std()
        if self.reads == "logged":
            self.log("probe", F.cross_entropy(self.probe(outputs[0]), y))
            return loss
        return loss + 0.5 * F.cross_entropy(self.probe(outputs[1]), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.head(torch.stack(self._run(x)[1]).mean(0)), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.head(torch.stack(self._run(batch[0])[1]).mean(0))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class FrozenOutsideNet(L.LightningModule):
    """A block container (``module="blocks"``) whose parameters outside the blocks include a frozen
    final norm and a layer the forward never uses; the optimizer gets every parameter with weight
    decay, as ``AdamW(self.parameters())`` does."""

    def __init__(self, optimizer: str = "adamw", depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(depth)])
        self.norm = nn.LayerNorm(HIDDEN).requires_grad_(False)
        self.unused = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = torch.tanh(self.embed(x))
        for block in self.blocks:
            hidden = block(hidden)
        loss = F.cross_entropy(self.head(self.norm(hidden)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)


class FrozenStartNet(TinyNet):
    """Fine-tuning with a frozen start: the first half of the layers frozen, the optimizer given the
    trainable parameters only (so a stage holding only frozen layers has none to give it)."""

    def __init__(self, frozen: int = 4, depth: int = 8) -> None:
        super().__init__(depth=depth)
        self.layers[:frozen].requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.01, weight_decay=0.01)


class FrozenStartInfNet(FrozenStartNet):
    """:class:`FrozenStartNet` whose last layer's gradient (on the last stage) becomes inf at step 2."""

    def on_train_start(self) -> None:
        last = self.layers._modules.get("7")  # of the 8 layers
        if last is not None:
            last.weight.register_hook(lambda g: g * float("inf") if self.trainer.global_step == 2 else g)


class NamedLayersNet(TinyNet):
    """:class:`TinyNet` whose Sequential is built from an ``OrderedDict`` (as torchvision's ViT encoder
    is): its layers are named ``encoder_layer_<i>``, not by their index (past 10, their names'
    order is not the layers')."""

    def __init__(self, depth: int = 12) -> None:
        super().__init__(depth=depth)
        self.layers = nn.Sequential(OrderedDict((f"encoder_layer_{i}", layer) for i, layer in enumerate(self.layers)))


@skippable(stash=["a"])
class StashA(nn.Module):
    """Stashes its output for the last layer (a U-Net's outer skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(IN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        stash("a", y)
        return y


@skippable(stash=["b"])
class StashB(nn.Module):
    """Stashes its output for layer 3 (an inner skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        stash("b", y)
        return y


@skippable(pop=["b"])
class PopB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x + pop("b")))


@skippable(pop=["a"])
class PopA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([x, pop("a")], dim=1))


def _stashing(name: str) -> type[nn.Module]:
    @skippable(stash=[name])
    class Stashing(nn.Module):
        def __init__(self, width: int = HIDDEN) -> None:
            super().__init__()
            self.linear = nn.Linear(width, HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.tanh(self.linear(x))
            stash(name, y)
            return y

    return Stashing


def _popping(name: str) -> type[nn.Module]:
    @skippable(pop=[name])
    class Popping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.linear(x) + pop(name))

    return Popping


def _middle() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())


class UNetSkips(TinyNet):
    """A 12-layer U-Net-shaped ``nn.Sequential`` with four skips declared the torchgpipe way: ``s0``
    from layer 0 to 10, ``s1`` from 1 to 6, ``s2`` from 2 to 4, ``s3`` from 5 to 8 (nested and
    overlapping, some over several stages once split in 4 or 8)."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.layers = nn.Sequential(
            _stashing("s0")(IN), _stashing("s1")(), _stashing("s2")(), _middle(), _popping("s2")(),
            _stashing("s3")(), _popping("s1")(), _middle(), _popping("s3")(), _middle(), _popping("s0")(),
            nn.Linear(HIDDEN, CLASSES),
        )  # fmt: skip


class SkipNet(TinyNet):
    """A U-Net-shaped ``nn.Sequential`` with two skips declared the torchgpipe way: layer 0 stashes
    ``a`` for layer 5, layer 1 stashes ``b`` for layer 3. Split in 2: both cross 0 -> 1; in 3: both
    cross 0 -> 1, and ``a`` goes on through stage 1 to stage 2."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.layers = nn.Sequential(
            StashA(), StashB(), nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()), PopB(),
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()), PopA(),
        )  # fmt: skip

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("skip_val_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


class _CarryA(StashA):
    """:class:`StashA`'s layer with ``a`` carried in the hidden state instead of stashed."""

    stashes = ()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        y = torch.tanh(self.linear(x))
        return y, y


class _CarryB(StashB):
    stashes = ()

    def forward(self, carried: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        x, a = carried
        y = torch.tanh(self.linear(x))
        return y, a, y


class _CarryPopB(PopB):
    pops = ()

    def forward(self, carried: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        x, a, b = carried
        return torch.tanh(self.linear(x + b)), a


class _CarryPopA(PopA):
    pops = ()

    def forward(self, carried: tuple[torch.Tensor, ...]) -> torch.Tensor:  # type: ignore[override]
        x, a = carried
        return self.linear(torch.cat([x, a], dim=1))


class _CarryMiddle(nn.Sequential):
    def forward(self, carried: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return (super().forward(carried[0]), *carried[1:])


class CarriedSkipNet(SkipNet):
    """:class:`SkipNet` with its two skips carried in the hidden state (a tuple every layer hands on)
    instead of stashed: the same parameters under the same names, the same sums, and what crosses a
    boundary is the ordinary hidden state: the oracle of a schedule that has no plain one."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.layers = nn.Sequential(
            _CarryA(), _CarryB(), _CarryMiddle(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()), _CarryPopB(),
            _CarryMiddle(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()), _CarryPopA(),
        )  # fmt: skip


class CharBlock(nn.Module):
    """A pre-norm transformer block (causal self-attention and an MLP) of :class:`CharGPT`."""

    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharGPT(L.LightningModule):
    """A character-level GPT of its own (no Hugging Face): token and position embeddings, blocks, a final
    norm and a head. ``blocks`` is an ``nn.ModuleList`` the forward loops over, or (``sequential``) an
    ``nn.Sequential`` it calls; ``tied``: the head's weight is the token embedding's."""

    VOCAB, WIDTH, LENGTH = 17, 16, 6

    def __init__(self, depth: int = 4, sequential: bool = False, tied: bool = False, optimizer: str = "sgd") -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(self.VOCAB, self.WIDTH)
        self.pos_emb = nn.Embedding(self.LENGTH, self.WIDTH)
        blocks = [CharBlock(self.WIDTH) for _ in range(depth)]
        self.blocks: nn.Module = nn.Sequential(*blocks) if sequential else nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(self.WIDTH)
        self.head = nn.Linear(self.WIDTH, self.VOCAB, bias=False)
        if tied:
            self.head.weight = self.tok_emb.weight
        self.optimizer = optimizer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(positions)
        if isinstance(self.blocks, nn.Sequential):
            x = self.blocks(x)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        loss = F.cross_entropy(self(ids).reshape(-1, self.VOCAB), targets.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def char_loader(n: int = 48, batch_size: int = 8) -> DataLoader:
    """Next-character data for :class:`CharGPT`: the targets are the ids shifted by one."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, CharGPT.VOCAB, (n, CharGPT.LENGTH + 1), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=batch_size)


class RecordHeld(L.Callback):
    """Writes, per rank, the bytes of every distinct tensor the module holds (parameters and buffers,
    through any attribute) and the names of its parameters, to ``<folder>/held<k>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import json

        seen: dict[int, int] = {}
        for t in list(pl_module.parameters()) + list(pl_module.buffers()):
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        names = [n for n, _ in pl_module.named_parameters()]
        with open(f"{self.folder}/held{trainer.global_rank}.json", "w") as f:
            json.dump({"bytes": sum(seen.values()), "names": names}, f)
