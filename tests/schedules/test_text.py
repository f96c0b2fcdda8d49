"""Schedules as text: every built-in schedule's action lists read back as written, a hand-written
text gets a built-in's traits, and a text that cannot run is refused naming the line and the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_pipe.config import PipelineConfig
from lightning_pipe.schedules import (
    REGROUPED_FOR_RENDEZVOUS,
    TRAITS,
    ScheduleTextError,
    build,
    format_schedule,
    load_schedule,
    one_f_one_b,
    parse_schedule,
    render,
    simulate,
    stage_positions,
    traits,
    validate,
)
from lightning_pipe.schedules.__main__ import main
from lightning_pipe.schedules.runnable import ScheduleRefused, runnable_schedule
from lightning_pipe.schedules.text import forward_like_text
from tests.torch_texts import TORCH_SCHEDULES, torch_text

GRID = [(ranks, m) for ranks in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 8)]

ONE_F_ONE_B = """# 1F1B on 2 processes and 4 micro-batches, by hand
0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3
F0@s1 B0@s1 F1@s1 B1@s1 F2@s1 B2@s1 F3@s1 B3@s1
"""


def _built(name: str) -> list:
    """Schedule ``name`` on the grid (and its stage counts), with and without NCCL's regrouping."""
    t = traits(name)
    counts = (2, 3) if t.interleaved else (t.virtual_stages,)
    built = []
    for (ranks, m), v, rendezvous in ((c, v, r) for c in GRID for v in counts for r in (False, True)):
        if name == "chimera" and m < 2:  # chain 1's stages compute nothing: no line could say where they live
            continue
        try:
            built.append(build(name, ranks, m, v, rendezvous=rendezvous))
        except ValueError:  # a count the schedule refuses
            continue
    return built


@pytest.mark.parametrize("name", sorted(TRAITS))
def test_every_built_in_schedule_round_trips_through_its_text(name: str) -> None:
    schedules = _built(name)
    assert len(schedules) >= 8, "the grid built too few of this schedule"
    for schedule in schedules:
        text = format_schedule(schedule)
        assert parse_schedule(text, schedule.name) == schedule, text
        if not traits(name).asynchronous and not (schedule.num_stages > 1 and name in REGROUPED_FOR_RENDEZVOUS):
            # without its communication, the reader places it as the built-in schedules do
            assert parse_schedule(format_schedule(schedule, compute_only=True), schedule.name) == schedule


def test_text_is_torchs_csv_cells_one_line_per_rank() -> None:
    text = format_schedule(build("zero_bubble", 2, 2), compute_only=True)
    assert text == "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n"
    assert parse_schedule(text).split_backward


def test_a_hand_written_1f1b_is_the_built_in_one_and_has_its_traits() -> None:
    schedule = load_schedule(ONE_F_ONE_B)  # torch's cells on one line, ours on the other, a comment
    built = one_f_one_b(2, 4)
    assert schedule.actions == built.actions and schedule.stage_to_rank == built.stage_to_rank
    t = traits(ONE_F_ONE_B)
    assert (t.asynchronous, t.split_backward, t.virtual_stages, t.planned) == (False, False, 1, False)
    assert build(ONE_F_ONE_B, 2, 4) is schedule
    assert simulate(schedule).bubble_fraction == simulate(built).bubble_fraction
    assert render(schedule).splitlines()[0] == render(built).splitlines()[0]
    with pytest.raises(ScheduleTextError, match="written for 2 pipeline stages .*asked for 4"):
        stage_positions(ONE_F_ONE_B, 4, 1)  # a run with another depth, refused when its layout is known
    config = PipelineConfig(schedule=ONE_F_ONE_B)
    assert (config.num_microbatches(2), config.virtual_stages) == (4, 1)
    short = runnable_schedule(traits(ONE_F_ONE_B), 2, 3, 1, rendezvous=False)  # a short last batch: 3 of 4
    assert short.num_microbatches == 3
    assert short.actions == tuple(tuple(a for a in actions if a.microbatch < 3) for actions in built.actions)
    with pytest.raises(ScheduleRefused, match="for 2 pipeline stages .* and 4 micro-batches; asked for 2 and 5"):
        runnable_schedule(traits(ONE_F_ONE_B), 2, 5, 1, rendezvous=False)


def test_a_text_file_places_its_stages_where_it_computes_them(tmp_path: Path) -> None:
    path = tmp_path / "v.csv"  # a V: stages 0 and 3 on process 0, 1 and 2 on process 1, split backward
    path.write_text(
        "0F0,0F1,3F0,3I0,3W0,3F1,3I1,3W1,0I0,0W0,0I1,0W1\n1F0,2F0,1F1,2F1,2I0,2W0,1I0,1W0,2I1,2W1,1I1,1W1\n"
    )
    t = traits(str(path))
    assert (t.virtual_stages, t.split_backward, t.label) == (2, True, "text 'v.csv'")
    assert stage_positions(str(path), 2, 2) == [0, 1, 1, 0]
    as_written = build(str(path), 2, 2, 2)
    assert build(str(path), 2, 2, 2, rendezvous=True).actions != as_written.actions  # deadlocks under NCCL as written
    for rendezvous in (False, True):  # regrouped under NCCL where it needs it, and evaluation on any count
        validate(build(str(path), 2, 2, 2, rendezvous=rendezvous), rendezvous=rendezvous)
        evaluation = runnable_schedule(traits(str(path)), 2, 3, 2, rendezvous, forward=True)
        assert evaluation.forward_only and evaluation.stage_to_rank == (0, 1, 1, 0)
    assert forward_like_text(t.text, 1).num_microbatches == 1  # type: ignore[arg-type]
    config = PipelineConfig(schedule_text=path)  # a Path too
    assert (config.schedule, config.virtual_stages, config.num_microbatches(2)) == (str(path), 2, 2)
    path.write_text(ONE_F_ONE_B)  # edited: read again
    assert (traits(str(path)).virtual_stages, PipelineConfig(schedule_text=path).num_microbatches(2)) == (1, 4)


@pytest.mark.parametrize(
    "text, match",
    [
        ("0F0,0X0\n", r"line 1: '0X0' is not an action"),
        ("\n# rank 0\n0F0,0B0\n0F1,0B1\n", r"line 4: stage 0 is computed on line 3 too"),
        ("0F0,0B0\n2F0,2B0\n", r"stage\(s\) \[1\] computed on no line"),
        ("0F0,0B0,0F1,0B1\n\n1B0,1F0,1F1,1B1\n", r"line 3 \(rank 1\), position 0 \(B0@s1\): backward before its"),
        ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", r"missing \['B1@s0'\]"),
        (
            "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1SEND_B0,1B0\n",
            r"line 2 \(rank 1\), position 2 \(SEND_B0@s1\): sends before B0@s1 produced it",
        ),
        ("0F0,0B-1\n1F0,1B0\n", r"line 1: RECV_B-1@s0 is work of the batch before .* asynchronous ones are built in"),
        ("0F-1,0B-1\n", r"line 1: F-1@s0 is work of the batch before"),
        ("0F0\n1F0\n", r"no backward"),
        ("0F0,1F0,1B0,0B0\n2F0,2B0\n", r"compute \[2, 1\] stages; .* the same number of stages"),
        ("0F0,3F1,3B1,0B0\n2F1,1F0,1B0,2B1\n", r"2 chains of stages, Chimera's .* use schedule='chimera'"),
        ("+0F0,0B0\n", r"line 1: \+F0@s0 joins no compute before it"),
        (
            "0F0,0F1,+0B1,0B0\n",
            r"line 1 \(rank 0\), overlapped unit F1@s0 B1@s0: one micro-batch's forward and backward",
        ),
        ("nowhere/my.csv", r"no such file"),
    ],
)
def test_a_text_that_cannot_run_is_refused_naming_the_line(text: str, match: str) -> None:
    with pytest.raises(ScheduleTextError, match=match):
        PipelineConfig(schedule_text=text)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"chunks": 3}, r"runs 4 micro-batches per batch. Give chunks=4"),
        ({"virtual_stages": 2}, r"computes 1 stage\(s\) on each line"),
        ({"plan": "auto"}, r"plan='auto'\) chooses the schedule"),
        ({"pipemare_warmup": 10}, r"is synchronous"),
        ({"xpipe_predictor": "adam"}, r"xpipe"),
    ],
)
def test_a_text_schedule_is_synchronous_and_fixes_its_chunks(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PipelineConfig(schedule=ONE_F_ONE_B, **options)


def test_an_unknown_name_says_a_schedule_can_be_text() -> None:
    with pytest.raises(ValueError, match=r"Valid schedules: .*1f1b.*your own goes in schedule_text=: the path"):
        traits("zigzag")


def test_the_command_checks_a_file_and_prints_its_timeline(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    main(["--write", "interleaved_1f1b", "2", "2"])
    written = capsys.readouterr().out
    assert parse_schedule(written) == parse_schedule(format_schedule(build("interleaved_1f1b", 2, 2, 2)))
    (tmp_path / "mine.txt").write_text(written)
    main([str(tmp_path / "mine.txt")])
    assert capsys.readouterr().out.endswith(
        "mine.txt: 4 stages, 2 micro-batches, bubble 20.0%, peak micro-batches held per stage 2, 2, 2, 1\n"
    )
    (tmp_path / "bad.txt").write_text(written.replace("2B1", "2B0", 1))
    with pytest.raises(SystemExit):
        main([str(tmp_path / "bad.txt")])
    assert "schedule text 'bad.txt'" in capsys.readouterr().err


def test_b_is_the_whole_backward_i_and_w_its_halves_mixed_in_one_text() -> None:
    """torch's meaning: rank 0 runs B0 whole and B1 as I1 and W1; rank 1 the other way round. A split
    text runs each B as its input gradient and, at once, its weight gradient."""
    schedule = load_schedule("0F0,0F1,0B0,0I1,0W1\n1F0,1I0,1W0,1F1,1B1\n")
    assert schedule.split_backward
    assert [str(a) for a in schedule.compute(0)] == ["F0@s0", "F1@s0", "B0@s0", "W0@s0", "B1@s0", "W1@s0"]
    assert [str(a) for a in schedule.compute(1)] == ["F0@s1", "B0@s1", "W0@s1", "F1@s1", "B1@s1", "W1@s1"]
    assert not load_schedule("0F0,0B0\n1F0,1B0\n").split_backward  # B alone: the whole backward, unsplit
    with pytest.raises(ScheduleTextError, match=r"missing \['W0@s0', 'W0@s1'\]"):
        load_schedule("0F0,0I0\n1F0,1I0\n")  # an input gradient without its weight gradient


@pytest.mark.parametrize("communication", [False, True])
def test_torch_s_dualpipev_text_is_the_built_in_dualpipev(communication: bool) -> None:
    """torch's ScheduleDualPipeV writes B for the micro-batches it runs whole (in its F&B pairs,
    ``(0F3;3B1)OVERLAP_F_B``) and I and W for the others: read as torch means them, its text runs the
    built-in's computes and overlapped units."""
    for ranks, chunks in [(2, 4), (2, 7), (4, 8)]:
        schedule = load_schedule(torch_text("ScheduleDualPipeV", ranks, chunks, communication=communication))
        built = build("dualpipev", ranks, chunks)
        assert [schedule.compute(r) for r in range(ranks)] == [built.compute(r) for r in range(ranks)]
        assert schedule.overlapped == built.overlapped and schedule.stage_to_rank == built.stage_to_rank


@pytest.mark.parametrize("name", sorted(TORCH_SCHEDULES))
def test_every_torch_schedule_s_text_loads_or_is_refused_naming_the_line(name: str) -> None:
    """Compute only and with torch's communication (its UNSHARD, RESHARD and REDUCE_GRAD skipped, the
    hand-overs between one rank's stages placed): each loads, validated under gloo and NCCL, with the
    stages, micro-batches and split backward torch wrote; torch's 1F1B order (its last rank from
    micro-batch 1) is refused, as torch's runtime refuses it."""
    for ranks, chunks in [(2, 4), (3, 6), (4, 8)]:
        for communication in (False, True):
            if name == "Schedule1F1B":
                with pytest.raises(ScheduleTextError, match=rf"line {ranks} \(rank {ranks - 1}\).*before its forward"):
                    load_schedule(torch_text(name, ranks, chunks))
                break
            text = torch_text(name, ranks, chunks, communication=communication)
            schedule = load_schedule(text)
            v = TORCH_SCHEDULES[name] or 2
            assert (schedule.num_ranks, schedule.num_stages, schedule.num_microbatches) == (ranks, ranks * v, chunks)
            assert schedule.split_backward == any(kind in text for kind in ("I", "W"))
            assert ("UNSHARD" in text) == communication  # skipped where written
            runnable_schedule(traits(text), ranks, chunks, v, rendezvous=True)


def test_torch_s_parameter_actions_are_skipped_and_its_hand_overs_placed() -> None:
    text = torch_text("ScheduleZBVZeroBubble", 2, 4, communication=True)
    assert "1SEND_F0" not in text and "2RECV_F0" not in text  # stage 1 hands over to stage 2 on rank 1
    schedule = load_schedule(text)
    rank1 = [str(a) for a in schedule.actions[1]]
    assert rank1.index("SEND_F0@s1") == rank1.index("F0@s1") + 1 and "RECV_F0@s2" in rank1
    assert rank1.index("RECV_F0@s2") < rank1.index("F0@s2")
    with pytest.raises(ScheduleTextError, match=r"'\(0F1;0SEND_F0\)OVERLAP_F_B': an overlapped pair holds computes"):
        load_schedule("0F0,(0F1;0SEND_F0)OVERLAP_F_B\n")


@pytest.mark.parametrize("name", sorted(set(TORCH_SCHEDULES) - {"Schedule1F1B"}))
def test_a_short_last_batch_runs_the_text_s_first_micro_batches(name: str) -> None:
    """A batch that splits into fewer micro-batches than the text numbers runs the text without the
    others' actions: under gloo every count from 1 runs, for every torch text; an overlapped pair that
    loses a member runs what is left one compute after the other."""
    for ranks, chunks in [(2, 6), (4, 8)]:
        for communication in (False, True):
            text = torch_text(name, ranks, chunks, communication=communication)
            whole = load_schedule(text)
            for m in range(1, chunks):
                short = runnable_schedule(traits(text), ranks, m, whole.virtual_stages, rendezvous=False)
                assert short.num_microbatches == m
                for rank in range(ranks):
                    assert list(short.actions[rank]) == [a for a in whole.actions[rank] if a.microbatch < m]
                units = [u for mine in short.overlapped for u in mine]
                assert all(a.microbatch < m for u in units for a in u)
                assert len(units) == sum(all(a.microbatch < m for a in u) for mine in whole.overlapped for u in mine)


def test_an_order_nccl_cannot_pair_is_refused_saying_what_to_change() -> None:
    """Rank 1 forwards micro-batch 1 first, rank 0 sends 0 first: gloo pairs each message with its
    micro-batch; under NCCL no regrouping runs it, refused naming the text and the remedies."""
    text = "0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F1,1B1,1F0,1B0,1F2,1B2,1F3,1B3\n"
    runnable_schedule(traits(text), 2, 4, 1, rendezvous=False)
    with pytest.raises(
        ScheduleRefused, match=r"schedule text 'text' with 4 of its 4 micro-batches cannot run under NCCL"
    ):
        runnable_schedule(traits(text), 2, 4, 1, rendezvous=True)
    with pytest.raises(ScheduleRefused, match="take the micro-batches they exchange in the same order, drop_last=True"):
        runnable_schedule(traits(text), 2, 3, 1, rendezvous=True)


def test_a_reordering_that_deadlocks_is_refused_before_launch() -> None:
    """Rank 1 wants micro-batch 1 first, which rank 0 sends only after micro-batch 0's backward, which
    waits for rank 1: refused when the strategy is built, saying where each rank waits."""
    text = "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n"
    with pytest.raises(
        ScheduleTextError, match=r"deadlocks: line 1 \(rank 0\) at B0@s0 .*; line 2 \(rank 1\) at RECV_F1@s1"
    ):
        PipelineConfig(schedule_text=text)
