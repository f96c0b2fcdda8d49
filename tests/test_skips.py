"""Skip connections across the stages of a split ``nn.Sequential``, declared the torchgpipe way
(``@skippable(stash=..., pop=...)``): the stashed tensor travels with the micro-batch to the stage
that pops it, its gradient back, and the model trains as plain training does."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_pipe.runtime.crossing.skips import routes_line, skip_routes, skips_from, skips_into
from tests.models import CarriedSkipNet, SkipNet, UNetSkips, fit_plain, loader, plain_trainer
from tests.pipeline import assert_same_weights, fit_pipeline, pipeline_trainer
from tests.runtime.test_async_pipeline import _cycle, _reference, _stage_delays


def test_which_stage_sends_which_skip_to_which_is_decided_from_the_declarations() -> None:
    layers = list(SkipNet().layers)
    assert skip_routes(layers, [3, 3]) == {(0, 1): ("a", "b")}
    routes = skip_routes(layers, [2, 2, 2])  # a goes from stage 0 straight to stage 2, not through stage 1
    assert routes == {(0, 1): ("b",), (0, 2): ("a",)}
    assert skips_from(routes, 0) == ((1, ("b",)), (2, ("a",))) and skips_from(routes, 1) == ()
    assert skips_into(routes, 1) == ((0, ("b",)),) and skips_into(routes, 2) == ((0, ("a",)),)
    assert skip_routes(layers, [1, 1, 4]) == {(0, 2): ("a",), (1, 2): ("b",)}
    assert skip_routes(layers, [6]) == {}
    assert routes_line(routes, [0, 1, 2]) == (
        "; skip connections sent from the stashing stage to the popping stage 0 -> 1: b; 0 -> 2: a"
    )
    assert routes_line(skip_routes(layers, [1, 1, 1, 3]), [0, 1, 1, 0]) == (  # zbv's V: stages 0 and 3 on process 0
        "; skip connections sent from the stashing stage to the popping stage 0 -> 3: a (in process 0); 1 -> 3: b"
    )
    with pytest.raises(ValueError, match=r"Layer 3 declares @skippable\(pop=\['b'\]\), but no earlier layer"):
        skip_routes([layers[0], layers[2], layers[2], layers[3], layers[5]], [5])


def test_a_skip_connection_across_stages_trains_validates_and_predicts_as_plain() -> None:
    """2 stages: ``a`` and ``b`` cross 0 -> 1; their gradients reach layers 0 and 1 (before: the
    pop on stage 1 found nothing stashed)."""
    torch.manual_seed(0)
    piped = SkipNet()
    reference = copy.deepcopy(piped)
    fit_plain(reference)
    fit_pipeline(piped, 2, chunks=2)
    assert_same_weights(reference, piped)
    val = loader(n=24, seed=1)
    plain = plain_trainer().validate(reference, val, verbose=False)[0]["skip_val_loss"]
    assert pipeline_trainer(2).validate(piped, val, verbose=False)[0]["skip_val_loss"] == pytest.approx(plain)
    torch.testing.assert_close(
        torch.cat(pipeline_trainer(2).predict(piped, val)), torch.cat(plain_trainer().predict(reference, val))
    )


def _logged_posts(
    monkeypatch: pytest.MonkeyPatch, folder: Path, streams: int = 0
) -> Callable[[int], list[tuple[int, int, int]]]:
    """Every op each process posts, as (is_send, peer, tag), read back per rank after the fit (the
    processes are forked, so they run the patched transport); with ``streams`` (how many a transport
    of that many stages has), the tag's stream only (the tag is ``stream + streams x micro-batch``)."""
    from lightning_pipe.runtime import p2p

    def logging(post: Callable) -> Callable:
        def posting(self: p2p.Transport, ops: list[p2p.Op]) -> list:
            with open(folder / f"ops-{dist.get_rank()}.txt", "a") as log:
                log.writelines(f"{int(op.is_send)} {op.peer} {op.tag}\n" for op in ops)
            return post(self, ops)

        return posting

    for name in ("post", "post_skips"):
        if hasattr(p2p.Transport, name):
            monkeypatch.setattr(p2p.Transport, name, logging(getattr(p2p.Transport, name)))

    def posts(rank: int) -> list[tuple[int, int, int]]:
        lines = (folder / f"ops-{rank}.txt").read_text().splitlines()
        ops = [(int(send), int(peer), int(tag)) for send, peer, tag in map(str.split, lines)]
        return [(send, peer, tag % streams) for send, peer, tag in ops] if streams else ops

    return posts


def test_a_skip_goes_straight_to_the_stage_that_pops_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """3 stages ([2, 2, 2]): ``a`` goes from stage 0 to stage 2 and its gradient back, never through stage 1
    (before: stage 1 received it and sent it on beside the hidden state); recomputed with its skips."""
    streams = 2 * 3 + 4 * 3 * 3  # per stage activations and gradients, per pair of stages skips (3 kinds)
    posts = _logged_posts(monkeypatch, tmp_path, streams)
    torch.manual_seed(0)
    piped = SkipNet()
    reference = copy.deepcopy(piped)
    fit_plain(reference)
    fit_pipeline(piped, 3, chunks=4, balance=[2, 2, 2], recompute="always")
    assert_same_weights(reference, piped)
    first, middle, last = posts(0), posts(1), posts(2)
    # each micro-batch's message its own tag: stage 1's first batch receives micro-batches 0..3 on stream 2
    tags = [
        tag for send, peer, tag in _logged_posts(monkeypatch, tmp_path)(1) if (send, peer, tag % streams) == (0, 0, 2)
    ]
    assert [tag // streams for tag in tags[:4]] == [0, 1, 2, 3]
    # streams: activations into stage s 2s, gradients out of it 2s + 1; a skip from stage s to t 6 + 4 (3s + t),
    # its gradient + 1: b (0 -> 1) 10 and 11, a (0 -> 2) 14 and 15 (its header, + 2, is not posted as an op)
    hidden_in = [op for op in middle if op == (0, 0, 2)]
    hidden_out = [op for op in middle if op[:2] == (1, 2)]
    assert hidden_in and len(hidden_out) == len(hidden_in)  # before: hidden state, a, b in; hidden state, a out
    assert {op for op in middle if op[0]} == {(1, 2, 4), (1, 0, 1), (1, 0, 11)}  # a's streams never reach stage 1
    assert {op for op in middle if not op[0]} == {(0, 0, 2), (0, 2, 3), (0, 0, 10)}
    assert [op for op in first if op[1:] == (2, 14)] == [(1, 2, 14)] * len(hidden_in)  # a, straight to stage 2
    assert [op for op in last if op[1:] == (0, 15)] == [(1, 0, 15)] * len(hidden_in)  # its gradient straight back
    assert [op for op in first if op[1:] == (2, 15)] == [(0, 2, 15)] * len(hidden_in)


def test_skips_train_as_plain_under_a_v_shaped_schedule() -> None:
    """zbv, 4 stages on 2 processes (a V): a skip between one process's own stages (in memory), one across."""
    torch.manual_seed(0)
    piped = SkipNet()
    reference = copy.deepcopy(piped)
    fit_plain(reference)
    fit_pipeline(piped, 2, chunks=4, schedule="zbv")
    assert_same_weights(reference, piped)


def test_skips_train_as_plain_under_chimera() -> None:
    """Chimera's two directions: the down pipeline sends stage 0's skips to stage 1 (process 0 -> 1), the up
    pipeline the same between their copies (process 1 -> 0); both copies' gradients summed (before: refused)."""
    torch.manual_seed(0)
    piped = SkipNet()
    reference = copy.deepcopy(piped)
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule="chimera", chunks=4)
    assert_same_weights(reference, piped)


@pytest.mark.slow
def test_skips_train_as_plain_with_sharded_replicas() -> None:
    """2 stages x 2 replicas, FSDP2 shards: the skips cross within each replica's pipeline."""
    torch.manual_seed(0)
    piped = SkipNet()
    reference = copy.deepcopy(piped)
    fit_plain(reference, loader(batch_size=24))
    fit_pipeline(piped, 4, loader(batch_size=12), stages=2, chunks=3, data_parallel="shard")
    assert_same_weights(reference, piped)


def test_an_undeclared_or_missing_stash_is_refused_when_the_stage_ends() -> None:
    from lightning_pipe.runtime.crossing.skips import skip_scope, take_skips
    from lightning_pipe.skips import pop, stash

    with skip_scope({"a": torch.zeros(1)}) as scope:
        stash("b", torch.ones(1))
        with pytest.raises(RuntimeError, match=r"stashed 'b' again before a later layer popped it"):
            stash("b", torch.ones(1))
        with pytest.raises(RuntimeError, match=r"popped 'c', which no earlier layer stashed"):
            pop("c")
    assert [t.item() for t in take_skips(scope, ("a", "b"), 0)] == [0.0, 1.0]
    with pytest.raises(RuntimeError, match=r"Stage 0's layers stashed \['b'\] without declaring them"):
        take_skips(scope, ("a",), 0)
    with pytest.raises(RuntimeError, match=r"declare @skippable\(stash=\['c'\]\) but did not stash them"):
        take_skips(scope, ("a", "b", "c"), 0)


def test_a_u_net_on_four_processes_trains_as_plain() -> None:
    """1f1b, [3, 3, 3, 3]: skips from stage 0 to stages 1, 2 and 3, and from 1 to 2."""
    torch.manual_seed(0)
    piped = UNetSkips()
    reference = copy.deepcopy(piped)
    fit_plain(reference)
    fit_pipeline(piped, 4, chunks=4, balance=[3, 3, 3, 3])
    assert_same_weights(reference, piped)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "dualpipev", "zbv"])
def test_a_u_net_on_four_processes_trains_as_plain_under_schedules_with_several_stages_per_process(
    schedule: str,
) -> None:
    """8 stages on 4 processes, [2, 1, 1, 2, 1, 2, 2, 1]: skips between stages 0 -> 6, 0 -> 4, 1 -> 3, 3 -> 5;
    interleaved puts stages 0 and 4 on process 0 (a skip in memory); the V's put a stage's neighbours on other
    processes than rank + 1."""
    torch.manual_seed(0)
    piped = UNetSkips()
    reference = copy.deepcopy(piped)
    fit_plain(reference, loader(batch_size=8))
    options = {"virtual_stages": 2} if schedule == "interleaved_1f1b" else {}
    balance = [2, 1, 1, 2, 1, 2, 2, 1]
    fit_pipeline(piped, 4, loader(batch_size=8), chunks=8, balance=balance, schedule=schedule, **options)
    assert_same_weights(reference, piped)


@pytest.mark.parametrize(
    "schedule, chunks",
    [
        ("pipedream_2bw", 3),
        pytest.param("pipedream", 2, marks=pytest.mark.slow),
        pytest.param("wpipe", 3, marks=pytest.mark.slow),
    ],
)
def test_skips_follow_the_delayed_rule_of_the_schedules_that_stash_weights(schedule: str, chunks: int) -> None:
    """(Before: refused.) 3 stages across steps (an epoch's end, its drain and its short batch included):
    each skip travels with its micro-batch, so its stage's backward reaches the weight version of its
    forward, and the weights follow the rule's one-process reference as the plain Sequential's do."""
    torch.manual_seed(0)
    piped = SkipNet()
    piped.optimizer = "plain-sgd"
    reference = copy.deepcopy(piped)
    steps = 9
    batches = [b for _, b in zip(range(steps), iter(_cycle(loader())))]
    _reference(reference, batches, 0.1, _stage_delays(schedule, 3, chunks, reference))
    fit_pipeline(piped, 3, schedule=schedule, chunks=chunks, max_steps=steps, balance=[2, 2, 2])
    assert_same_weights(reference, piped)


@pytest.mark.parametrize("schedule", ["pipemare", pytest.param("xpipe", marks=pytest.mark.slow)])
def test_skips_sent_straight_train_as_skips_carried_in_the_hidden_state_under_predicted_weights(
    schedule: str,
) -> None:
    """The schedules that predict weights have no one-process rule for this model: the same skips carried in
    the hidden state (a tuple every layer hands on, the ordinary path) are the oracle, 3 stages across steps."""
    torch.manual_seed(0)
    piped = SkipNet()
    carried = CarriedSkipNet()
    carried.load_state_dict(piped.state_dict())
    initial = copy.deepcopy(piped)
    for model in (carried, piped):
        fit_pipeline(model, 3, schedule=schedule, chunks=2, max_steps=9, balance=[2, 2, 2])
    assert_same_weights(carried, piped)
    with pytest.raises(AssertionError):
        assert_same_weights(initial, piped)  # it trained


@pytest.mark.slow
def test_a_u_net_on_four_processes_trains_as_plain_under_chimera() -> None:
    torch.manual_seed(0)
    piped = UNetSkips()
    reference = copy.deepcopy(piped)
    fit_plain(reference)
    fit_pipeline(piped, 4, chunks=4, schedule="chimera", balance=[3, 3, 3, 3])
    assert_same_weights(reference, piped)


@pytest.mark.parametrize("measured", [{"balance": "time"}, {"balance": "memory"}, {"plan": "auto"}])
def test_skips_train_as_plain_with_a_measured_balance(measured: dict) -> None:
    """The profile runs each layer with what earlier layers stashed (before: "A layer stashed 'a' again
    before a later layer popped it", the layers run without the skips' scope); the planner's too."""
    torch.manual_seed(0)
    piped = SkipNet()
    reference = copy.deepcopy(piped)
    fit_plain(reference)
    fit_pipeline(piped, 2, **({"chunks": 2} if "balance" in measured else {}), **measured)
    assert_same_weights(reference, piped)
