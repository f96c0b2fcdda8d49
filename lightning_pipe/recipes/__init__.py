"""Ready-made recipes: VGG19 on CIFAR-100, BERT masked-language-model pre-training, and a
Hugging Face Llama or GPT-2 causal LM.

Installed as ``lightning_pipe.recipes``; each recipe is an ordinary LightningModule (VGG19 and
BERT: layers in one ``nn.Sequential``; the causal LM: the model's own list of blocks), plus a
LightningDataModule that works offline by default.
"""

from collections.abc import Callable
from types import ModuleType
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

BUILDS = ("auto", "eager", "configure_model")
LARGE = 100_000_000  # parameters above which "auto" builds in configure_model()


def builds_in_configure_model(build: str, layers: Callable[[], nn.Module]) -> bool:
    """Whether a recipe creates its layers in ``configure_model()`` (so that under the pipeline
    each rank materialises only its stage) instead of in ``__init__``. ``"auto"``: when the model
    has more than ``LARGE`` parameters, counted on the meta device (nothing is allocated)."""
    if build not in BUILDS:
        raise ValueError(f"recipe.model.build={build!r}: valid values are {', '.join(BUILDS)}.")
    if build != "auto":
        return build == "configure_model"
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in layers().parameters()) > LARGE


def require_transformers(what: str) -> ModuleType:
    """``transformers``, an optional dependency (the ``hf`` extra), or an error saying how to get it."""
    try:
        import transformers
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"{what} needs Hugging Face transformers: pip install 'lightning-pipe[hf]' ({error})"
        ) from error
    return transformers


class EpochShuffle(RandomSampler):
    """A random order drawn from the run's seed and the epoch alone (Lightning calls ``set_epoch``), so a
    run resumed from a checkpoint (``resume=``) reads the batches an uninterrupted run reads. The epoch
    is passed on to a dataset that takes it (``set_epoch``), for augmentations drawn per sample and epoch.

    It keeps ``RandomSampler``'s own iteration (a permutation from its generator, reseeded at each
    epoch), so the pipeline steers it as it steers ``shuffle=True``: the same permutation, each replica
    its part, and a resume in the middle of an epoch reads on from where the checkpoint left off."""

    def __init__(self, data: Any) -> None:
        self.seed = torch.initial_seed()  # seed_everything(seed) sets it
        super().__init__(data, generator=torch.Generator().manual_seed(self.seed))
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        assert self.generator is not None
        self.generator.manual_seed(self.seed + epoch)
        if hasattr(self.data_source, "set_epoch"):
            self.data_source.set_epoch(epoch)


class TrainValData(L.LightningDataModule):
    """The recipes' data modules: ``setup`` fills ``train`` and ``val`` (datasets); training
    batches are shuffled, and a last short batch dropped so that every step has the full batch."""

    batch_size: int
    num_workers: int

    def __init__(self) -> None:
        super().__init__()
        self.train: Any | None = None
        self.val: Any | None = None

    def train_dataloader(self) -> DataLoader:
        assert self.train is not None
        return DataLoader(
            self.train,
            batch_size=self.batch_size,
            sampler=EpochShuffle(self.train),
            num_workers=self.num_workers,
            drop_last=True,
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val is not None
        return DataLoader(self.val, batch_size=self.batch_size, num_workers=self.num_workers)
