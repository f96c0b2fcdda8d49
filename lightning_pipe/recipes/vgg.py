"""VGG for 32x32 images as one ``nn.Sequential``, and CIFAR-100 data.

Data sources:

- ``cifar100``: the standard CIFAR-100 python archive (``cifar-100-python.tar.gz``) in ``root``,
  downloaded there (and checked against its MD5) when ``download`` is true and the network allows.
- ``synthetic`` (default): needs no download. Each class is a fixed random 32x32 colour pattern;
  samples are that pattern, randomly shifted, scaled and with noise added. A model learns it
  within a few hundred steps, which is what a first run or a benchmark needs; it is not CIFAR.
"""

from __future__ import annotations

import hashlib
import pickle
import tarfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from lightning_pipe.recipes import TrainValData, builds_in_configure_model

CFG = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    13: [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}
CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
CIFAR100_MD5 = "eb9058c3a382ffc7106e4002c42a8d85"
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


def vgg_layers(
    depth: int = 19, batch_norm: bool = True, num_classes: int = 100, width: float = 1.0, dropout: float = 0.0
) -> nn.Sequential:
    """VGG-``depth`` for 32x32 inputs, every conv, norm, activation and pool a layer of its own so
    that the pipeline can cut anywhere. ``width`` scales the channel counts."""
    if depth not in CFG:
        raise ValueError(f"VGG depth must be one of {sorted(CFG)}, got {depth}")
    layers: list[nn.Module] = []
    channels = 3
    for item in CFG[depth]:
        if item == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        out = max(1, round(int(item) * width))
        layers.append(nn.Conv2d(channels, out, 3, padding=1, bias=not batch_norm))
        if batch_norm:
            layers.append(nn.BatchNorm2d(out))
        layers.append(nn.ReLU(inplace=True))
        channels = out
    layers.append(nn.Flatten())
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(channels, num_classes))
    return nn.Sequential(*layers)


class VGGClassifier(L.LightningModule):
    """Image classification with VGG; SGD with momentum and a cosine learning-rate schedule.

    ``build``: ``"eager"`` creates the layers in ``__init__``, ``"configure_model"`` in
    ``configure_model()`` (under the pipeline: on the meta device, each rank materialising its
    stage), ``"auto"`` (default) the latter above 100M parameters (``width >= 3``)."""

    def __init__(
        self,
        depth: int = 19,
        batch_norm: bool = True,
        num_classes: int = 100,
        width: float = 1.0,
        dropout: float = 0.0,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        max_steps: int = 1000,
        build: str = "auto",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers: nn.Sequential | None = None
        if not builds_in_configure_model(build, self._vgg_layers):
            self.configure_model()

    def _vgg_layers(self) -> nn.Sequential:
        hp = self.hparams
        return vgg_layers(hp.depth, hp.batch_norm, hp.num_classes, hp.width, hp.dropout)

    def configure_model(self) -> None:
        """Create the layers (here for models above 100M parameters, ``width >= 3``, see ``build``)."""
        if self.layers is None:
            self.layers = self._vgg_layers()

    @property
    def strategy_defaults(self) -> dict[str, Any]:
        """``PipelineStrategy`` arguments for this model unless the run sets them: ``balance`` by
        parameters, the command line's split for every recipe so far (the convolutions grow wider
        with depth). By the step times of docs/balance.md, ``"time"`` and ``"uniform"`` split VGG
        faster: ``strategy.balance=time``."""
        return {"balance": "parameters"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        # No sync_dist=True: under the pipeline every rank already logs the last stage's value, averaged over
        # the replicas, and Lightning drops sync_dist for a strategy that is not `is_distributed` (the
        # pipeline's, so that Lightning never swaps in its own sampler): its warning asking for it is moot.
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, hp.max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


# ---------------------------------------------------------------------------- CIFAR-100
def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare_cifar100(root: str | Path, download: bool = False, md5: str | None = "official") -> Path:
    """The extracted ``cifar-100-python`` folder under ``root``, extracting (and downloading) the
    archive when needed; the archive must have ``md5`` ("official": the published archive's, None:
    unchecked). Raises a message that says where to put the archive when it is missing."""
    if md5 == "official":
        md5 = CIFAR100_MD5
    root = Path(root)
    folder = root / "cifar-100-python"
    if (folder / "train").is_file() and (folder / "test").is_file():
        return folder
    archive = root / "cifar-100-python.tar.gz"
    if not archive.is_file():
        if not download:
            raise FileNotFoundError(
                f"CIFAR-100 is not in {root}. Put cifar-100-python.tar.gz (from {CIFAR100_URL}) there, or set "
                "recipe.data.download=true, or use the offline source recipe.data.source=synthetic."
            )
        root.mkdir(parents=True, exist_ok=True)
        partial = archive.with_suffix(".part")
        try:
            urllib.request.urlretrieve(CIFAR100_URL, partial)
        except OSError as err:
            raise RuntimeError(
                f"Could not download CIFAR-100 from {CIFAR100_URL} ({err}). Without network access, copy "
                f"cifar-100-python.tar.gz into {root} by hand, or use recipe.data.source=synthetic."
            ) from err
        partial.rename(archive)
    if md5 is not None and _md5(archive) != md5:
        raise RuntimeError(
            f"{archive} is damaged or not the CIFAR-100 python archive (MD5 mismatch); delete it and retry."
        )
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(root, filter="data")
    return folder


def load_cifar100_split(folder: str | Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Images as uint8 ``(N, 3, 32, 32)`` and fine labels ``(N,)`` from the extracted folder."""
    with open(Path(folder) / ("train" if train else "test"), "rb") as f:
        entry = pickle.load(f, encoding="bytes")
    images = torch.as_tensor(entry[b"data"], dtype=torch.uint8).view(-1, 3, 32, 32)
    labels = torch.as_tensor(entry[b"fine_labels"], dtype=torch.long)
    return images, labels


class AugmentedImages(Dataset):
    """uint8 images, normalised, with random crop (4-pixel padding) and horizontal flip when ``augment``.

    The crop and flip of an image depend only on the image and the epoch (``set_epoch``, called by
    the recipes' sampler), never on the process's random state: every pipeline stage loads the batch
    itself and must see the same images, and a run resumed from a checkpoint sees the crops an
    uninterrupted run sees."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        augment: bool,
        mean: Sequence[float],
        std: Sequence[float],
        seed: int = 0,
    ) -> None:
        self.images, self.labels, self.augment, self.seed = images, labels, augment, seed
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[index].float().div_(255)
        if self.augment:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + index * 7_919 + self.epoch)
            padded = F.pad(x, (4, 4, 4, 4), mode="reflect")
            i, j = torch.randint(0, 9, (2,), generator=g).tolist()
            x = padded[:, i : i + 32, j : j + 32]
            if torch.rand((), generator=g) < 0.5:
                x = x.flip(-1)
        return (x - self.mean) / self.std, self.labels[index]


def synthetic_images(n: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Class patterns with random shifts, contrast and noise, as uint8 images (see the module doc)."""
    g = torch.Generator().manual_seed(1234)  # the same class patterns for every split
    patterns = F.interpolate(
        torch.rand(num_classes, 3, 8, 8, generator=g), size=32, mode="bilinear", align_corners=False
    )
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    images = patterns[labels]
    shifts = torch.randint(-3, 4, (n, 2), generator=g)
    images = torch.stack([img.roll(tuple(s.tolist()), dims=(1, 2)) for img, s in zip(images, shifts)])
    contrast = 0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=g)
    images = (images - 0.5) * contrast + 0.5 + 0.15 * torch.randn(images.shape, generator=g)
    return images.clamp(0, 1).mul(255).to(torch.uint8), labels


class CIFAR100Data(TrainValData):
    def __init__(
        self,
        source: str = "synthetic",
        root: str = "data",
        download: bool = False,
        batch_size: int = 64,
        num_workers: int = 0,
        augment: bool = True,
        num_classes: int = 100,
        synthetic_train: int = 10000,
        synthetic_val: int = 1000,
    ) -> None:
        super().__init__()
        if source not in ("synthetic", "cifar100"):
            raise ValueError(f"recipe.data.source={source!r}: valid sources are 'synthetic' and 'cifar100'.")
        self.source, self.root, self.download = source, root, download
        self.batch_size, self.num_workers, self.augment = batch_size, num_workers, augment
        self.num_classes, self.synthetic_train, self.synthetic_val = num_classes, synthetic_train, synthetic_val

    def prepare_data(self) -> None:
        if self.source == "cifar100":
            prepare_cifar100(self.root, self.download)

    def setup(self, stage: str | None = None) -> None:
        if self.source == "cifar100":
            folder = prepare_cifar100(self.root, download=False)
            train, val = load_cifar100_split(folder, True), load_cifar100_split(folder, False)
        else:
            train = synthetic_images(self.synthetic_train, self.num_classes, seed=0)
            val = synthetic_images(self.synthetic_val, self.num_classes, seed=1)
        self.train = AugmentedImages(*train, augment=self.augment, mean=CIFAR100_MEAN, std=CIFAR100_STD)
        self.val = AugmentedImages(*val, augment=False, mean=CIFAR100_MEAN, std=CIFAR100_STD)
