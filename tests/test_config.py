"""Every strategy argument as one frozen value, checked once."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_pipe.config import PipelineConfig


def test_defaults_and_the_schedules_own_stages_per_process() -> None:
    assert PipelineConfig().virtual_stages == 1 and PipelineConfig().num_microbatches(3) == 6
    assert PipelineConfig(schedule="zbv").virtual_stages == 2
    assert PipelineConfig(schedule="interleaved_1f1b", virtual_stages=3, chunks=5).num_microbatches(3) == 5


def test_the_groups_hold_the_arguments_and_flat_names_read_through_them() -> None:
    config = PipelineConfig(schedule="gpipe", chunks=4, stages=2, replicas_sync="elastic", start_method="fork")
    assert (config.steps.schedule, config.steps.chunks, config.layout.stages) == ("gpipe", 4, 2)
    assert (config.replicas.replicas_sync, config.launch.start_method) == ("elastic", "fork")
    assert (config.schedule, config.chunks, config.stages) == ("gpipe", 4, 2) and "chunks" in dir(config)
    assert PipelineConfig(steps=config.steps, layout=config.layout) == config.replace(
        replicas_sync="allreduce", start_method="popen"
    )
    with pytest.raises(AttributeError, match="no attribute 'chunk'"):
        config.chunk  # noqa: B018
    with pytest.raises(TypeError, match=r"'chunk' \(did you mean 'chunks'\?\)"):
        PipelineConfig(chunk=4)


def test_a_config_cannot_change_and_a_replacement_is_checked_again() -> None:
    config = PipelineConfig(schedule="gpipe")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.chunks = 4  # type: ignore[misc]
    planned = config.replace(schedule="interleaved_1f1b", virtual_stages=2, chunks=4)
    assert (planned.schedule, planned.virtual_stages, planned.chunks, config.chunks) == ("interleaved_1f1b", 2, 4, None)
    with pytest.raises(ValueError, match="holds exactly 2 stages per process"):
        config.replace(schedule="zbv")  # gpipe's one stage per process does not fit ZB-V


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"schedule": "zigzag"}, "Unknown pipeline schedule 'zigzag'"),
        ({"chunks": 0}, "chunks=0"),
        ({"balance": "speed"}, "unknown balance"),
        ({"balance": [2, True]}, "list of layer counts"),
        ({"recompute": "sometimes"}, "unknown mode"),
        ({"plan": "manual"}, "plan='manual'"),
        ({"check_data": 0}, "check_data=0"),
        ({"stages": 0}, "stages=0"),
        ({"data_parallel": "zero"}, "data_parallel='zero'"),
        ({"start_method": "thread"}, "start_method='thread'"),
        ({"schedule": "gpipe", "virtual_stages": 2}, "one stage per process"),
    ],
)
def test_a_bad_argument_is_refused_naming_it(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**arguments)


def test_checkpoint_is_the_deprecated_name_of_recompute() -> None:
    from lightning_pipe import PipelineStrategy

    with pytest.warns(DeprecationWarning, match="write recompute='always'"):
        strategy = PipelineStrategy(checkpoint="always")
    assert strategy.recompute == strategy.config.recompute == strategy.config.checkpoint == "always"
    assert PipelineStrategy(recompute="except_last").recompute == "except_last"
    assert PipelineStrategy().recompute == "never"
    with pytest.raises(ValueError, match="give recompute= only"):
        PipelineStrategy(recompute="never", checkpoint="always")


def test_your_own_schedule_comes_in_its_own_field_and_schedule_with_a_path_is_deprecated(tmp_path) -> None:
    from lightning_pipe.schedules import build
    from lightning_pipe.schedules.text import format_schedule

    text = format_schedule(build("1f1b", 2, 4))
    path = tmp_path / "mine.csv"
    path.write_text(text)
    by_file = PipelineConfig(schedule_text=path)
    assert (by_file.schedule, by_file.schedule_text, by_file.chunks) == (str(path), str(path), None)
    assert by_file.num_microbatches(2) == 4 and by_file.virtual_stages == 1
    by_text = PipelineConfig(schedule_text=text)
    assert by_text.schedule == text and by_text.num_microbatches(2) == 4
    assert dataclasses.replace(by_text.steps, chunks=4).schedule_text == text  # a copy keeps it, without a warning
    with pytest.warns(DeprecationWarning, match=r"schedule_text='.*mine\.csv'"):
        old = PipelineConfig(schedule=str(path))
    assert (old.schedule, old.schedule_text) == (str(path), str(path))
    with pytest.raises(ValueError, match="both name the schedule"):
        PipelineConfig(schedule="gpipe", schedule_text=path)
    assert PipelineConfig(schedule="gpipe").schedule_text is None
