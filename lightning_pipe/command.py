"""The ``lightning-pipe`` command's entry point: Hydra's answers that run no job (``--help``,
``--hydra-help``, ``--cfg job``) come from Hydra alone, without importing Lightning and torch (seconds
on every call); everything else goes to :func:`lightning_pipe.cli.main`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

#: Hydra's flags that print and exit without running the job
ANSWERS = ("--help", "-h", "--hydra-help", "--cfg", "-c")
#: what ``--cfg`` takes
CFG_PARTS = ("job", "hydra", "all")
#: overrides that :func:`lightning_pipe.command_keys.check_overrides` accepts without looking: a group's option
#: and the top-level keys (config.yaml's own); anything else is checked by the command line itself
PLAIN_KEYS = ("recipe", "strategy", "trainer", "checkpoint", "logger", "resume", "seed", "timeline")


def answers_alone(args: Sequence[str]) -> bool:
    """Whether Hydra alone answers ``args``: a flag of :data:`ANSWERS`, and besides it only ``--resolve``,
    ``--cfg``'s part and overrides of :data:`PLAIN_KEYS` (a sweep, ``plan`` or a key that the command line
    checks go the whole way)."""
    if not any(arg in ANSWERS for arg in args):
        return False
    previous = ""
    for arg in args:
        key = arg.split("=", 1)[0]
        plain = "=" in arg and (key in PLAIN_KEYS or key.startswith("hydra."))
        if not (arg in ANSWERS or arg == "--resolve" or plain or (previous in ("--cfg", "-c") and arg in CFG_PARTS)):
            return False
        previous = arg
    return True


def answer() -> None:
    """Hydra's answer, with the configuration and the job name (``cli``) of :func:`lightning_pipe.cli.main`."""
    import hydra

    def job(cfg: Any) -> None:
        raise AssertionError("Hydra ran the job: lightning_pipe.command.answers_alone let through a training run")

    job.__module__ = "lightning_pipe.cli"  # Hydra names the job after the module (hydra.job.name)
    config_dir = str(Path(str(files("lightning_pipe.conf"))).resolve())  # as lightning_pipe.cli.CONFIG_DIR
    hydra.main(version_base="1.3", config_path=config_dir, config_name="config")(job)()


def main() -> None:
    if answers_alone(sys.argv[1:]):
        answer()
        return
    from lightning_pipe.command_keys import check_overrides

    check_overrides([] if sys.argv[1:2] == ["plan"] else sys.argv[1:])  # a misspelt key: before torch's import
    from lightning_pipe.cli import main as run_command

    run_command()
