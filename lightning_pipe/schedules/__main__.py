"""``python -m lightning_pipe.schedules``: check your own schedule text and see its timeline before
training, or write a built-in schedule's text to start from (:mod:`lightning_pipe.schedules.text`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_pipe.schedules import build, format_schedule, render
from lightning_pipe.schedules.traits import text_traits, traits


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m lightning_pipe.schedules FILE``: check a schedule text as training would
    and print its timeline, or the problem with its line (exit status 1); ``--write NAME PROCESSES
    CHUNKS`` prints a built-in schedule's text to start from."""
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.schedules", description=main.__doc__)
    parser.add_argument("file", nargs="?", help="a schedule text (.csv or .txt), one line of actions per rank")
    parser.add_argument("--write", nargs=3, metavar=("NAME", "PROCESSES", "CHUNKS"), help="a built-in's text")
    args = parser.parse_args(argv)
    if args.write:
        name, ranks, chunks = args.write[0], int(args.write[1]), int(args.write[2])
        print(format_schedule(build(name, ranks, chunks, traits(name).virtual_stages), compute_only=True), end="")
        return
    if args.file is None:
        parser.error("give a schedule text's file, or --write NAME PROCESSES CHUNKS")
    try:
        schedule = text_traits(args.file).text
    except ValueError as err:
        print(err, file=sys.stderr)
        raise SystemExit(1) from None
    assert schedule is not None  # a text's traits hold its schedule
    print(render(schedule))


if __name__ == "__main__":
    main()
