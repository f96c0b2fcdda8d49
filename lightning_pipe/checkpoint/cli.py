"""``python -m lightning_pipe.checkpoint DIRECTORY OUTPUT``: consolidate a pipeline checkpoint."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lightning_pipe.checkpoint.consolidate import consolidate


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pipe.checkpoint",
        description="Turn a lightning-pipe checkpoint directory into a plain Lightning checkpoint file.",
    )
    parser.add_argument("checkpoint", help="the pipeline checkpoint directory")
    parser.add_argument("output", help="the plain checkpoint file to write")
    args = parser.parse_args(argv)
    checkpoint = consolidate(args.checkpoint, args.output)
    print(f"wrote {args.output}: {len(checkpoint['state_dict'])} tensors")
