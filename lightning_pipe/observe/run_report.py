"""The command line's summary at the end of a run, a pure function of plain values. The line
printed once the model is split is :mod:`lightning_pipe.trainer.layout_report`'s."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def summary_lines(
    output: Path,
    checkpoint: str | None,
    loss: float | None,
    steps: int,
    wall_seconds: float,
    samples: int,
    train_seconds: float,
    written: Sequence[str] = (),
) -> str:
    """The command line's end-of-run summary. ``samples``: training samples over all replicas;
    ``train_seconds``: the training loop's time without validation, so samples/s is the
    training throughput; ``written``: the other files and folders the run wrote (metrics, the
    TensorBoard folder, timeline), one row each."""
    speed = f"{samples / train_seconds:.1f}" if samples and train_seconds > 0 else "n/a (no training step)"
    rows = [
        ("output folder", str(output)),
        ("checkpoint", checkpoint if checkpoint else "none; checkpoint=true to save one"),
        ("final loss", f"{loss:.4f}" if loss is not None else "n/a (no loss logged)"),
        ("steps", str(steps)),
        ("wall time", f"{wall_seconds:.1f} s"),
        ("samples/s", speed + (" (the training loop, validation left out)" if samples and train_seconds > 0 else "")),
    ]
    rows += [("written" if i == 0 else "", path) for i, path in enumerate(written)]
    width = max(len(name) for name, _ in rows)
    return "\n".join(["lightning-pipe: run finished"] + [f"  {name:<{width}}  {value}" for name, value in rows])
