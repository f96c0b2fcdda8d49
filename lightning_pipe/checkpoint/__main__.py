"""``python -m lightning_pipe.checkpoint DIRECTORY OUTPUT``: consolidate a pipeline checkpoint.

A package's ``__main__`` rather than ``if __name__ == "__main__"`` in the module: ``lightning_pipe``
imports the checkpoint module itself, and running an already imported module with ``-m`` makes
Python warn that it was found in ``sys.modules``."""

from lightning_pipe.checkpoint.cli import main

main()
