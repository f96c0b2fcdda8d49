"""The lines a run prints about itself: the layout line and the command line's summary."""

from __future__ import annotations

from pathlib import Path

from lightning_pipe.observe.run_report import summary_lines
from lightning_pipe.runtime.topology import Layout
from lightning_pipe.trainer.layout_report import activations_part, layout_line, rank_info, tells_crossing


def test_layout_line_names_stages_replicas_and_processes() -> None:
    assert layout_line(2, 1, [2, 2], [0], "1f1b", 4) == (
        "lightning-pipe: 2 stages (2 processes), layers per stage [2, 2], schedule 1f1b, 4 chunks"
    )
    assert layout_line(2, 2, [2, 2], [0], "1f1b", 8, global_batch=128) == (
        "lightning-pipe: 2 stages x 2 replicas (4 processes), layers per stage [2, 2], schedule 1f1b, 8 chunks, "
        "global batch 128"
    )
    # one stage of the whole model on each of 2 replicas (was "1 stages, layers per stage [4]")
    assert layout_line(1, 2, [4], [0], "gpipe", 1, global_batch=64).startswith(
        "lightning-pipe: 1 stage x 2 replicas (2 processes), layers per stage [4], schedule gpipe, 1 chunk, global "
        "batch 64"
    )


def test_the_layout_line_names_each_stages_activation_policy_and_the_predicted_peak() -> None:
    assert activations_part(("never",) * 2, (None, None)) == ""  # everything kept: nothing added
    assert activations_part(("never", "never"), (0, None), (3 * 2**19, 3 * 2**19)) == (
        "; activations per stage: stage 0 offload k=0 (1.50 MiB predicted), stage 1 keep (1.50 MiB predicted)"
    )
    assert activations_part(("always", "never"), (1, None)) == (
        "; activations per stage: stage 0 always, offload k=1, stage 1 keep"
    )


def test_layout_line_with_virtual_stages_says_processes_x_virtual_stages() -> None:
    line = layout_line(2, 1, [1, 1, 1, 1], [0, 2], "interleaved_1f1b", 4)
    assert line == (
        "lightning-pipe: 2 processes x 2 virtual stages = 4 stages (process 0 holds stages 0 and 2), "
        "layers per stage [1, 1, 1, 1], schedule interleaved_1f1b, 4 chunks"
    )
    with_replicas = layout_line(2, 3, [1, 1, 1, 1], [0, 3], "zbv", 4)
    assert "= 4 stages (process 0 holds stages 0 and 3) x 3 replicas (6 processes), " in with_replicas


def test_layout_line_says_whose_stage_the_model_summary_counts() -> None:
    assert layout_line(2, 1, [2, 2], [0], "1f1b", 4, summary=True).endswith(
        "4 chunks; the model summary below counts rank 0's stage 0 only"
    )
    assert layout_line(2, 1, [1, 1, 1, 1], [0, 3], "zbv", 4, summary=True).endswith(
        "; the model summary below counts rank 0's stages 0 and 3 only"
    )
    assert "summary" not in layout_line(1, 2, [4], [0], "1f1b", 4, summary=True)  # rank 0 holds the whole model


def test_each_boundary_says_once_what_crosses_it_from_the_process_that_sends_it(caplog) -> None:
    """The line about values crossing beside the hidden state: every boundary's, not only rank 0's
    (before: rank-zero only, so the later boundaries of a 3-stage run went unreported)."""
    # 4 stages (2 processes x 2 virtual stages): all four stages tell (the last sends nothing); replica 1 none
    assert [s for s in range(4) if tells_crossing(s, 4, 0, mirrored=False)] == [0, 1, 2, 3]
    assert not any(tells_crossing(s, 4, 1, mirrored=False) for s in range(4))
    # Chimera on 2 processes: 4 schedule stages, two copies of 2 split stages: the first copy's tell
    assert [s for s in range(4) if tells_crossing(s, 4, 0, mirrored=True)] == [0, 1]
    with caplog.at_level("INFO", logger="lightning.pytorch"):
        rank_info(2)("lightning-pipe: stage 2 sends on ...")
    assert caplog.messages == ["[rank: 2] lightning-pipe: stage 2 sends on ..."]


def test_summary_lists_folder_checkpoint_loss_steps_time_and_speed() -> None:
    text = summary_lines(Path("/runs/a"), "/runs/a/checkpoints/last.ckpt", 2.345678, 20, 12.34, 640, 4.0)
    assert text.splitlines() == [
        "lightning-pipe: run finished",
        "  output folder  /runs/a",
        "  checkpoint     /runs/a/checkpoints/last.ckpt",
        "  final loss     2.3457",
        "  steps          20",
        "  wall time      12.3 s",
        "  samples/s      160.0 (the training loop, validation left out)",
    ]
    empty = summary_lines(Path("/runs/b"), None, None, 0, 1.0, 0, 0.0)
    assert "checkpoint     none; checkpoint=true to save one" in empty
    assert "final loss     n/a" in empty and "samples/s      n/a (no training step)" in empty


def test_chimera_names_the_split_stages_process_0_holds(monkeypatch) -> None:
    """Chimera on 2 processes: process 0 holds stage 0 and a copy of stage 1 (schedule stages 0 and 3)."""
    from lightning_pipe.trainer import layout_report as run_report

    monkeypatch.setattr(run_report, "shows_model_summary", lambda trainer: True)
    monkeypatch.setattr(run_report, "loader_batch_size", lambda trainer: None)
    line = run_report.describe_layout(None, Layout(2, 1), [2, 2], [0, 1, 1, 0], "chimera", 4)
    assert line.endswith("the model summary below counts rank 0's stages 0 and 1 only"), line


def test_a_placed_layout_names_rank_0s_stages_and_where_each_stage_sits(monkeypatch) -> None:
    """Ranks placed by speed: rank 0 holds the second position, and the line says where each sits."""
    from lightning_pipe.trainer import layout_report as run_report

    monkeypatch.setattr(run_report, "shows_model_summary", lambda trainer: True)
    monkeypatch.setattr(run_report, "loader_batch_size", lambda trainer: None)
    line = run_report.describe_layout(None, Layout(2, 2, (1, 3, 0, 2)), [3, 5], [0, 1], "1f1b", 4)
    assert "the model summary below counts rank 0's stage 1 only" in line, line
    assert line.endswith("; ranks placed: stage 0 on ranks 1, 3; stage 1 on ranks 0, 2"), line


def test_the_summary_lists_every_file_the_run_wrote(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from lightning_pipe.cli import written_files

    logs = tmp_path / "logs" / "version_0"
    logs.mkdir(parents=True)
    (logs / "metrics.csv").write_text("step\n")
    (tmp_path / "timeline.svg").write_text("<svg/>")
    (tmp_path / "cli.log").write_text("")
    written = written_files(tmp_path, SimpleNamespace(logger=SimpleNamespace(log_dir=str(logs))))
    assert written == [str(logs / "metrics.csv"), str(tmp_path / "timeline.svg"), str(tmp_path / "cli.log")]
    (logs / "metrics.csv").unlink()  # TensorBoard's event files instead
    assert written_files(tmp_path, SimpleNamespace(logger=SimpleNamespace(log_dir=str(logs))))[0].endswith(
        "--logdir " + str(logs) + ")"
    )
    text = summary_lines(tmp_path, None, 1.0, 2, 3.0, 4, 1.0, written)
    assert f"  written        {logs / 'metrics.csv'}" in text and f"\n                 {tmp_path / 'cli.log'}" in text
