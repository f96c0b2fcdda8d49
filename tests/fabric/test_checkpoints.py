"""``fabric.save``/``fabric.load``'s state dictionaries read as the project's checkpoints: which key holds the
pipelined module, which the optimizers, what is refused; and a resume on 4 processes from a ``fabric.save``
equals the run that went on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_pipe.fabric.checkpoints import parts, stateful
from tests.fabric.fabric_runs import Run, fabric_pipeline_run, single_process


def test_the_state_is_read_as_module_optimizers_and_the_rest() -> None:
    module = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    state = {"model": module, "opt": optimizer, "step": 3, "scheduler": scheduler}
    assert parts(state, module) == ("model", ["opt"], {"step": 3, "scheduler": scheduler})
    assert stateful(scheduler) and not stateful(3)
    with pytest.raises(ValueError, match="a module other than the pipelined one"):
        parts({"model": module, "ema": nn.Linear(2, 2)}, module)


@pytest.mark.timeout(600)
def test_a_resume_from_fabric_save_on_four_processes_equals_the_run_that_went_on(tmp_path: Path) -> None:
    """Train 2 steps, fabric.save, go on to 4 (the uninterrupted run); a new process group loads the save and
    trains steps 3 and 4: the same weights (SGD with momentum: the optimizer's state is resumed too)."""
    arguments = {"schedule": "1f1b", "chunks": 4}
    whole = Run(steps=4, arguments=arguments, momentum=0.9, save_after=2)
    went_on = fabric_pipeline_run(tmp_path, 4, whole)
    resumed = fabric_pipeline_run(tmp_path, 4, Run(steps=4, arguments=arguments, momentum=0.9, resume=True))
    expected = single_process(whole)
    for rank, (a, b) in enumerate(zip(went_on, resumed)):
        assert a["losses"][2:] == b["losses"], rank  # the steps after the save, bit for bit
        torch.testing.assert_close(b["state"], a["state"], rtol=0, atol=0)
        for name, value in a["state"].items():
            torch.testing.assert_close(value, expected["state"][name], msg=lambda m, n=name, r=rank: f"{r} {n}: {m}")
