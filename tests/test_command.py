"""The command's entry point and the package's face: what Hydra answers alone (``--help``) and ``import
lightning_pipe`` import neither Lightning nor torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_pipe.command import answers_alone

ROOT = Path(__file__).resolve().parents[1]

# a fresh interpreter: --help through the entry point, then the package's face (the registration of
# strategy="pipeline" with a Lightning imported later: tests/scripts/train_two_stages.py, in
# tests/trainer/launch/test_launcher.py)
FRESH = """
import sys
sys.argv = ["lightning-pipe", "--help"]
from lightning_pipe.command import main
try:
    main()
except SystemExit as exit:
    assert exit.code in (None, 0), exit.code
import lightning_pipe
heavy = sorted(m for m in ("lightning", "torch", "lightning_pipe.cli", "lightning_pipe.strategy") if m in sys.modules)
print("imported:", heavy)
"""


def test_help_and_the_package_import_neither_lightning_nor_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", FRESH], cwd=ROOT, capture_output=True, text=True, timeout=240
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("lightning-pipe: pipeline model parallelism")  # Hydra's help, the config's template
    assert lines[-1] == "imported: []"


MISSPELT = """
import sys
from lightning_pipe.command import main
for args in (["strategy.chunk=4"], ["recipe=bert_mlm", "trainer.max_step=3"], ["plan=auto"]):
    sys.argv = ["lightning-pipe", *args]
    try:
        main()
    except SystemExit as exit:
        print(str(exit.code).splitlines()[0].split(". Valid keys")[0])
heavy = sorted(m for m in ("lightning", "torch", "lightning_pipe.cli", "lightning_pipe.config") if m in sys.modules)
print("imported:", heavy)
"""


def test_a_misspelt_key_is_answered_before_torch_and_lightning_are_imported() -> None:
    """``lightning-pipe strategy.chunk=4`` names the close key at once: the keys come from the configuration's
    files and Lightning's source (the Trainer's signature), not from importing them."""
    result = subprocess.run([sys.executable, "-c", MISSPELT], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "lightning-pipe: unknown key strategy.chunk (did you mean strategy.chunks?)",
        "lightning-pipe: unknown key trainer.max_step (did you mean trainer.max_steps?)",
        "lightning-pipe: unknown key plan (did you mean strategy.plan?)",
        "imported: []",
    ]


def test_the_trainer_keys_read_from_lightnings_source_are_its_signatures() -> None:
    import inspect

    import lightning as L

    from lightning_pipe.command_keys import trainer_keys

    assert trainer_keys() == tuple(p for p in inspect.signature(L.Trainer.__init__).parameters if p != "self")


@pytest.mark.parametrize(
    "args, alone",
    [
        (["--help"], True),
        (["-h", "recipe=llama"], True),
        (["--hydra-help"], True),
        (["--cfg", "job", "recipe=vgg19_cifar100", "hydra.run.dir=x"], True),
        (["-c", "all", "--resolve", "strategy=gpipe", "seed=3"], True),
        ([], False),  # a run
        (["strategy=gpipe"], False),
        (["--cfg", "job", "strategy.chunk=4"], False),  # the command line names the misspelt key first
        (["--help", "trainer.max_step=3"], False),
        (["-m", "--cfg", "job", "strategy=gpipe,1f1b"], False),  # a sweep
        (["plan", "--help"], False),
        (["--cfg", "everything"], False),
        (["+strategy.chunkz=3", "--help"], False),
    ],
)
def test_what_hydra_answers_alone(args: list[str], alone: bool) -> None:
    assert answers_alone(args) == alone
