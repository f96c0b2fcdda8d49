"""What comparing checksums costs when a rank loads its stage from a checkpoint.

    python benchmarks/checkpoint_checksums.py --prepare             # writes the checkpoint once
    python benchmarks/checkpoint_checksums.py --mode checked        # loads it, comparing every tensor
    python benchmarks/checkpoint_checksums.py --mode unchecked      # loads it, comparing none

The checkpoint holds one 256 MiB stage (16 float32 tensors of 2048 x 2048) written by
``write_shard``. A load reads the directory as a resuming rank does (``read`` with the stage's
names, tensors memory-mapped) and copies every tensor into the module, ``--loads`` times in one
process so that the loads, not the start of Python, dominate a whole-process timing; it prints the
median seconds of one load. ``unchecked`` passes no names, so it compares none of the tensors and
reads the same bytes otherwise. Time the two modes against each other in alternating rounds
(A B A B ...) with a whole-process timer and quote the ratio pair by pair. Files come from the page
cache after the first load, so this is the CPU cost of the checksum; from a cold disk the relative
cost is smaller.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_pipe.checkpoint import read, write_meta, write_shard

WIDTH, LAYERS = 2048, 16  # 16 x 2048 x 2048 x 4 bytes = 256 MiB
DEFAULT_PATH = Path(tempfile.gettempdir()) / "lightning-pipe-bench-checksums.ckpt"


def stage() -> nn.Module:
    """The module the stage loads into, its names as in the file (``layers.7.weight``)."""
    holder = nn.Module()
    with torch.device("meta"):
        holder.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    return holder


def prepare(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    state = {f"layers.{i}.weight": torch.randn(WIDTH, WIDTH) for i in range(LAYERS)}
    tag = {"token": "bench", "global_step": 0, "epoch": 0}
    write_shard(path, 0, state, None, tag=tag)
    write_meta(path, {"epoch": 0, "global_step": 0}, 1, tag)
    size = (path / "stage-00000.pt").stat().st_size
    print(f"wrote {path}: stage-00000.pt {size / 2**20:.1f} MiB")


def load(path: Path, checked: bool, module: nn.Module) -> float:
    start = time.perf_counter()
    names = list(module.state_dict()) if checked else ()
    _, shards = read(path, names=names)
    module.load_state_dict(shards[0]["state_dict"])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="write the checkpoint and exit")
    parser.add_argument("--mode", choices=("checked", "unchecked"), default="checked")
    parser.add_argument("--loads", type=int, default=8)
    parser.add_argument("--path", type=Path, default=DEFAULT_PATH)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.prepare:
        prepare(args.path)
        return
    module = stage().to_empty(device="cpu")
    times = [load(args.path, args.mode == "checked", module) for _ in range(args.loads)]
    print(f"{args.mode}: median {statistics.median(times):.4f} s per load of 256 MiB ({args.loads} loads)")


if __name__ == "__main__":
    main()
