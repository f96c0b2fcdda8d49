"""Handing a picture to Lightning's loggers: those that take images get it, the others are named once.

A ``TensorBoardLogger`` gets it through its ``SummaryWriter.add_image``; a logger with a
``log_image(key, images, step)`` method (``WandbLogger``) through that, as an (H, W, 3) ``uint8``
array; any other logger (``CSVLogger``, ``MLFlowLogger``, ...) is skipped with one warning per
logger type and process.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.loggers import TensorBoardLogger

_warned: set[str] = set()


def log_image(loggers: Iterable[Any], tag: str, image: torch.Tensor, step: int) -> list[Any]:
    """Log ``image`` ((H, W, 3) ``uint8``) under ``tag`` at ``step``; returns the loggers that took it."""
    if image.dim() != 3 or image.shape[-1] != 3 or image.dtype != torch.uint8:
        raise ValueError(f"log_image expects an (H, W, 3) uint8 image, got {tuple(image.shape)} {image.dtype}")
    took = []
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_image(tag, image, global_step=step, dataformats="HWC")
        elif callable(getattr(logger, "log_image", None)):
            logger.log_image(key=tag, images=[image.numpy()], step=step)
        else:
            name = type(logger).__name__
            if name not in _warned:
                _warned.add(name)
                warnings.warn(
                    f"{name} takes no images, so the picture {tag!r} is not logged to it. A TensorBoardLogger or a "
                    "logger with log_image (WandbLogger) shows it.",
                    stacklevel=2,
                )
            continue
        took.append(logger)
    return took
