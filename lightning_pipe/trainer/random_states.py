"""Every rank's random state in a checkpoint, restored on a resume under the same layout.

Lightning does not save the random state, so dropout (or any randomness a model or a step draws
from the process's generators) differs after a plain resume. The pipeline gathers every rank's
states (torch CPU, CUDA where in use, numpy where imported, Python's ``random``) into the
checkpoint's metadata and, on a resume under the same layout (the same ranks on the same stages and
replicas, the same layers per stage), gives each rank its own back where an uninterrupted run would
have them: before the first training step when the checkpoint was saved within an epoch, before
the training DataLoader's first iterator (which draws a seed from torch's state, as an
uninterrupted run does at an epoch's start) when it was saved at an epoch's end. Under another
layout the saved states belong to other stages: each rank is seeded from the step and its rank
instead, and rank 0 says so once.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn

KEY = "lightning_pipe_random"  # the checkpoint entry (in the metadata rank 0 writes)


def collect() -> dict[str, Any]:
    """This process's random states, as tensors and plain values (readable with ``weights_only``)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        states["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return states


def restore(states: Mapping[str, Any]) -> None:
    """Set this process's random states to ``states`` (from :func:`collect`)."""
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in states:
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def reseed(step: int, rank: int) -> None:
    """Seed every generator from the global seed, the step and the rank: the same on every resume."""
    seed = (int(os.environ.get("PL_GLOBAL_SEED", 0)) * 1_000_003 + step * 1_009 + rank) % 2**32
    torch.manual_seed(seed)  # and every CUDA device's
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed)


def gathered(key: list[Any]) -> dict[str, Any]:
    """Every rank's states (a collective: every rank calls it while saving), with the layout's key."""
    states = collect()
    if dist.is_available() and dist.is_initialized():
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, states)
    else:
        every = [states]
    return {"layout": key, "states": every}


class ResumedRandom:
    """The random state a resume hands back to this rank, once, where the run continues."""

    def __init__(self) -> None:
        self._states: Mapping[str, Any] | None = None
        self._reseed: Callable[[], None] | None = None

    def take(self, checkpoint: dict[str, Any], key: list[Any] | None, rank: int) -> dict[str, Any]:
        """Take this rank's states out of ``checkpoint`` (none where it holds none: plain Lightning's) and
        hand back the rest, Lightning's checkpoint."""
        saved, step = checkpoint.pop(KEY, None), int(checkpoint.get("global_step", 0))
        self._states, self._reseed = None, None
        if saved is None:
            return checkpoint
        if saved.get("layout") == key and rank < len(saved["states"]):
            self._states = saved["states"][rank]
            return checkpoint
        rank_zero_warn(
            "lightning-pipe: resuming under another layout than the checkpoint's (other ranks, stages or layers per "
            "stage): the saved random states belong to other stages, so model randomness (dropout) is not restored "
            "exactly; every rank is seeded from the step and its rank instead. Resume under the same layout for an "
            "exact resume (docs/training.md#what-a-resume-reads)."
        )
        self._reseed = lambda: reseed(step, rank)
        return checkpoint

    def at_data(self, mid_epoch: bool) -> None:
        """The training DataLoader is set up: a checkpoint saved at an epoch's end continues from here."""
        if not mid_epoch:
            self.at_step()

    def at_step(self) -> None:
        """A training step begins: whatever is still pending is restored now."""
        if self._states is not None:
            restore(self._states)
        elif self._reseed is not None:
            self._reseed()
        self._states, self._reseed = None, None
