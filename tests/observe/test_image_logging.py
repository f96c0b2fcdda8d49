"""Pictures to Lightning's loggers: TensorBoard's add_image, a logger's log_image, a warning for the rest."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from lightning_pipe.observe import TimelinePicture, image_logging
from lightning_pipe.observe.image_logging import log_image
from tests.models import TinyNet
from tests.pipeline import fit_pipeline


class _ImageLogger(Logger):
    """A logger with ``log_image(key, images, step)``, as WandbLogger has."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[tuple[str, list[Any], int]] = []

    @property
    def name(self) -> str:
        return "images"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_image(self, key: str, images: list[Any], step: int | None = None) -> None:
        self.images.append((key, images, step))


def test_each_kind_of_logger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image_logging, "_warned", set())
    image = torch.zeros(5, 7, 3, dtype=torch.uint8)
    image[1, 2] = torch.tensor([10, 20, 30], dtype=torch.uint8)
    tensorboard, images, csv = TensorBoardLogger(tmp_path, name="tb"), _ImageLogger(), CSVLogger(tmp_path, name="csv")
    calls: list[tuple] = []
    monkeypatch.setattr(tensorboard.experiment, "add_image", lambda *a, **k: calls.append((a, k)))
    with pytest.warns(UserWarning, match="CSVLogger takes no images"):
        took = log_image([tensorboard, images, csv], "pipeline/timeline", image, 4)
    assert took == [tensorboard, images]
    ((args, kwargs),) = calls
    assert args[0] == "pipeline/timeline" and args[1] is image
    assert kwargs == {"global_step": 4, "dataformats": "HWC"}
    ((key, logged, step),) = images.images
    assert (key, step) == ("pipeline/timeline", 4)
    assert logged[0].shape == (5, 7, 3) and logged[0][1, 2].tolist() == [10, 20, 30]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log_image([csv], "again", image, 5)  # warned once per logger type
    with pytest.raises(ValueError, match="uint8"):
        log_image([images], "bad", image.float(), 0)


def test_timeline_picture_reaches_tensorboard(tmp_path: Path) -> None:
    """A 2-process run: the TensorBoard event file holds the picture (1F1B, 2 ranks: the predicted
    and the measured panel, 960 pixels wide) and the stage metrics' scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_pipe.observe import StageMetrics

    logger = TensorBoardLogger(tmp_path, name="tb")
    fit_pipeline(
        TinyNet(), 2, chunks=3, max_steps=3, logger=logger, log_every_n_steps=1,
        callbacks=[TimelinePicture(None), StageMetrics()],
    )  # fmt: skip
    (events,) = (tmp_path / "tb").rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events.parent), size_guidance={"images": 0, "scalars": 0})
    accumulator.Reload()
    assert accumulator.Tags()["images"] == ["pipeline/timeline"]
    (picture,) = accumulator.Images("pipeline/timeline")
    panel = 8 + 2 * (28 + 6) + 10
    assert (picture.width, picture.height, picture.step) == (960, 2 * panel + 1, 3)
    for stage in range(2):
        bubbles = accumulator.Scalars(f"pipeline/stage{stage}/bubble")
        assert [b.step for b in bubbles] == [0, 1, 2]
        assert all(0 <= b.value < 1 for b in bubbles)
        assert all(s.value > 0 for s in accumulator.Scalars(f"pipeline/stage{stage}/samples_per_sec"))


def test_picture_needs_somewhere_to_go() -> None:
    with pytest.raises(ValueError, match=r"TimelinePicture\(path=None, to_loggers=False\) would draw nothing"):
        TimelinePicture(None, to_loggers=False)


def test_the_old_log_keyword_still_works_with_a_deprecation_warning() -> None:
    with pytest.warns(
        DeprecationWarning, match=r"TimelinePicture\(log=False\) is deprecated: write .*to_loggers=False"
    ):
        picture = TimelinePicture("t.svg", log=False)
    picture.log = print  # what Lightning does to every callback when fitting starts
    assert picture.to_loggers is False
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="draw nothing"):
        TimelinePicture(None, log=False)


def test_not_logging_survives_lightning_and_warns_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``to_loggers=False`` is kept although Lightning replaces every callback's ``log`` when fitting
    starts: the file is written, no logger gets the picture, and no logger is warned about (the
    warnings are errors here, in rank 0's process too)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setattr(image_logging, "_warned", set())
    warnings.filterwarnings(
        "error", message=".*takes no images"
    )  # inherited by the forked ranks; pytest restores the filters
    path = tmp_path / "timeline.svg"
    loggers = [CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")]
    fit_pipeline(
        TinyNet(), 2, chunks=3, max_steps=2, logger=loggers, callbacks=[TimelinePicture(path, to_loggers=False)]
    )
    assert "measured, the last training step" in path.read_text()
    (events,) = (tmp_path / "tb").rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events.parent), size_guidance={"images": 0})
    accumulator.Reload()
    assert accumulator.Tags()["images"] == []
