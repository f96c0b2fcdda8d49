"""Per-stage metrics in Lightning's loggers: the bubble from recorded spans, and every stage's
values reaching the logger of global rank 0 under every schedule and with replicas."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_pipe.observe import StageMetrics
from lightning_pipe.observe.stage_metrics import Window, bubble, busy_and_total, peak_memory, stage_metrics
from lightning_pipe.runtime.timings import Span
from tests.models import TinyNet, fit_plain
from tests.pipeline import fit_pipeline


def test_busy_and_total_count_compute_spans_against_the_step() -> None:
    spans = [
        Span("post", 1, 0, 0.0, 0.5),
        Span("wait", 1, 0, 0.5, 2.0),
        Span("F", 1, 0, 2.0, 3.0),
        Span("B", 1, 0, 3.0, 5.0),
        Span("W", 1, 0, 5.0, 5.5),
        Span("wait", -1, -1, 5.5, 6.0),
        Span("step", -1, -1, 0.0, 8.0),
    ]
    busy, total = busy_and_total(spans)
    assert (busy, total) == (3.5, 8.0)
    assert bubble(busy, total) == pytest.approx(0.5625)
    assert bubble(0.0, 0.0) == 0.0  # nothing ran: no bubble, not a division by zero
    assert bubble(2.0, 2.0) == 0.0 and bubble(0.0, 1.0) == 1.0


def test_stage_metrics_combine_replicas() -> None:
    mib = 1024.0 * 1024.0
    rows = [  # stage, busy, total, samples, seconds, peak bytes: stages 0 and 1, two replicas each
        Window(busy=3.0, total=4.0, samples=24, seconds=2.0, batches=2).row(0, 10 * mib),
        Window(busy=1.0, total=4.0, samples=24, seconds=3.0, batches=2).row(0, 30 * mib),
        Window(busy=2.0, total=4.0, samples=24, seconds=2.0, batches=2).row(1, float("nan")),
        Window(busy=2.0, total=4.0, samples=24, seconds=2.0, batches=2).row(1, float("nan")),
    ]
    metrics = stage_metrics(rows, "peak_rss_mib")
    assert metrics["pipeline/stage0/bubble"] == pytest.approx(0.5)  # 4 s busy of 8 s
    assert metrics["pipeline/stage0/samples_per_sec"] == pytest.approx(12 + 8)  # summed over replicas
    assert metrics["pipeline/stage0/peak_rss_mib"] == pytest.approx(30.0)  # the larger replica
    assert metrics["pipeline/stage1/bubble"] == pytest.approx(0.5)
    assert "pipeline/stage1/peak_rss_mib" not in metrics  # unreadable peaks are left out, not logged as NaN
    assert set(stage_metrics(rows[:1], "x", prefix="p")) == {
        "p/stage0/bubble",
        "p/stage0/samples_per_sec",
        "p/stage0/x",
    }


def test_peak_memory_on_cpu_is_the_process_peak_rss() -> None:
    name, peak = peak_memory(torch.device("cpu"))
    assert name == "peak_rss_mib"
    big = torch.ones(64, 1024, 1024, dtype=torch.uint8)  # 64 MiB touched
    after = peak_memory(torch.device("cpu"))[1]
    assert after >= peak and after >= big.numel()


def test_bad_arguments_and_strategies_are_refused() -> None:
    with pytest.raises(ValueError, match="every_n_steps"):
        StageMetrics(every_n_steps=0)
    with pytest.raises(MisconfigurationException, match="strategy='pipeline'"):
        fit_plain(TinyNet(), callbacks=[StageMetrics()])


def _logged(folder: Path) -> list[dict[str, float]]:
    """The rows of the CSVLogger's metrics.csv that carry stage metrics, empty cells dropped."""
    (path,) = folder.rglob("metrics.csv")
    with path.open() as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    return [row for row in rows if any(k.startswith("pipeline/") for k in row)]


def _assert_plausible(rows: list[dict[str, float]], stages: int, windows: int) -> None:
    assert len(rows) == windows
    for row in rows:
        assert {k.split("/")[1] for k in row if k.startswith("pipeline/")} == {f"stage{s}" for s in range(stages)}
        for s in range(stages):
            key = f"pipeline/stage{s}"
            assert 0.0 <= row[f"{key}/bubble"] < 1.0, row
            assert row[f"{key}/samples_per_sec"] > 0, row
            assert row[f"{key}/peak_rss_mib"] > 10, row  # a process with torch loaded holds well over 10 MiB


def test_every_stage_reaches_the_logger(tmp_path: Path) -> None:
    """1F1B on 2 processes, 12-sample batches: windows of 2 batches at steps 1 and 3, and the last
    window (step 4) at the end of training; the values are each window's, not cumulative."""
    torch.manual_seed(0)
    logger = CSVLogger(tmp_path, name="run")
    fit_pipeline(
        TinyNet(), 2, schedule="1f1b", chunks=3, max_steps=5, logger=logger, callbacks=[StageMetrics(every_n_steps=2)]
    )
    rows = _logged(tmp_path)
    _assert_plausible(rows, stages=2, windows=3)
    assert [row["step"] for row in rows] == [1.0, 3.0, 4.0]
    # stage 1 waits for stage 0's first forward and stage 0 for stage 1's first backward: both idle a while
    assert all(row["pipeline/stage1/bubble"] > 0 and row["pipeline/stage0/bubble"] > 0 for row in rows)


@pytest.mark.parametrize(
    "options",
    [
        {"schedule": "gpipe"},
        {"schedule": "zero_bubble"},
        {"schedule": "interleaved_1f1b", "depth": 8},
        {"schedule": "zbv", "depth": 8},
        {"schedule": "pipedream"},
        {"schedule": "pipedream_2bw"},
    ],
    ids=lambda o: o["schedule"],
)
def test_every_schedule(tmp_path: Path, options: dict) -> None:
    options = dict(options)
    torch.manual_seed(0)
    model = TinyNet(depth=options.pop("depth", 8))
    fit_pipeline(
        model,
        2,
        chunks=4,
        max_steps=4,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[StageMetrics(every_n_steps=2)],
        **options,
    )
    _assert_plausible(_logged(tmp_path), stages=2, windows=2)


def test_replicas_are_combined_per_stage(tmp_path: Path) -> None:
    """2 stages x 2 replicas: one set of values per stage; samples per second adds the replicas'."""
    torch.manual_seed(0)
    logger = CSVLogger(tmp_path, name="run")
    fit_pipeline(
        TinyNet(), 4, stages=2, chunks=3, max_steps=3, logger=logger, log_every_n_steps=3, callbacks=[StageMetrics()]
    )
    (row,) = _logged(tmp_path)
    _assert_plausible([row], stages=2, windows=1)
    assert not any(math.isnan(v) for v in row.values())
