"""Ready-made recipes: VGG19 on CIFAR-100, BERT masked-language-model pre-training, and a
Hugging Face Llama or GPT-2 causal LM.

Installed as ``lightning_pipe.recipes``; each recipe is an ordinary LightningModule whose layers
form one ``nn.Sequential``, plus a LightningDataModule that works offline by default.
"""

from types import ModuleType
from typing import Callable

from torch import nn

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
        raise ModuleNotFoundError(f"{what} needs Hugging Face transformers: pip install 'lightning-pipe[hf]' ({error})") from error
    return transformers
