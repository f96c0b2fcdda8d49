"""``offload=`` and ``recompute=`` per stage: saved activations moved to host memory between forward and backward
(host to host on CPU processes) train exactly as keeping them, under the schedules whose stages hold many
micro-batches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tests.models import TinyNet, fit_plain, loader
from tests.pipeline import assert_same_weights, fit_pipeline, twins


class RecordOffload(L.Callback):
    """Writes, per stage of each rank, the micro-batches it keeps and the peak bytes it put in host memory."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runners = trainer.strategy.pipeline.runners  # type: ignore[attr-defined]
        record = {
            s: (r.offload.keep if r.offload else None, r.offload.peak_host_bytes if r.offload else 0, r.recompute)
            for s, r in runners.items()
        }
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.parametrize(
    "schedule, offload, extra, keeps, processes",
    [
        # stage 0 offloads both micro-batches it holds, one comes back at a time; the last stage recomputes
        ("1f1b", "auto", {"recompute": ["never", "always"]}, [0, None], 2),
        # split backward: W finds what B fetched back; recomputed micro-batches save only the checkpoint's inputs
        ("zero_bubble", True, {"recompute": "except_last"}, [0, 0], 2),
        pytest.param(
            "interleaved_1f1b", [0, 1, None, 2], {"recompute": "auto"}, [0, 1, None, 2], 2, marks=pytest.mark.slow
        ),
        pytest.param("zbv", "auto", {}, None, 2, marks=pytest.mark.slow),
        pytest.param("dualpipev", True, {}, [0, 0, 0, 0], 2, marks=pytest.mark.slow),
        # 4 processes: the first stages hold the most micro-batches, the per-stage choice differs down the chain
        pytest.param(
            "1f1b", "auto", {"recompute": ["never", "never", "always", "never"]}, None, 4, marks=pytest.mark.slow
        ),
        pytest.param("zero_bubble", [0, 1, None, None], {}, [0, 1, None, None], 4, marks=pytest.mark.slow),
        pytest.param("interleaved_1f1b", True, {"recompute": "auto"}, None, 4, marks=pytest.mark.slow),
        pytest.param("zbv", "auto", {}, None, 4, marks=pytest.mark.slow),
        pytest.param("dualpipev", True, {"recompute": "except_last"}, None, 4, marks=pytest.mark.slow),
    ],
)
def test_offload_weights_equal_plain_training(
    schedule: str, offload: Any, extra: dict[str, Any], keeps: list[int | None] | None, processes: int, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet(depth=8 if processes == 2 else 16))  # two layers per virtual stage
    data = None if processes == 2 else loader(64, batch_size=16)  # full batches: dualpipev needs 2p micro-batches
    fit_plain(reference, data)
    chunks = 4 if processes == 2 else 8
    fit_pipeline(
        piped,
        processes,
        data,
        schedule=schedule,
        chunks=chunks,
        offload=offload,
        callbacks=[RecordOffload(tmp_path)],
        **extra,
    )
    assert_same_weights(reference, piped)
    stages: dict[int, Any] = {}
    for rank in range(processes):
        stages.update({int(s): v for s, v in json.loads((tmp_path / f"rank{rank}.json").read_text()).items()})
    if keeps is not None:
        assert [stages[s][0] for s in sorted(stages)] == keeps
    assert any(v[1] > 0 for v in stages.values())  # something went to host memory
    recompute = extra.get("recompute", "never")
    if isinstance(recompute, list):
        assert [stages[s][2] for s in sorted(stages)] == recompute


def test_offload_in_a_block_container() -> None:
    """The model's own loop over its blocks (``module="blocks"``): offload wraps the stage's whole step."""
    from tests.schedules.families.test_dualpipev_training import _data, _LoopNet

    torch.manual_seed(0)
    reference, piped = twins(_LoopNet())
    fit_plain(reference, _data())
    fit_pipeline(piped, 2, _data(), schedule="1f1b", chunks=4, module="blocks", offload=True)
    assert_same_weights(reference, piped)
