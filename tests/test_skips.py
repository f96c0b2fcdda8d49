"""Skip connections across the stages of a split ``nn.Sequential``, declared the torchgpipe way
(``@skippable(stash=..., pop=...)``): the stashed tensor travels with the micro-batch to the stage
that pops it, its gradient back, and the model trains as plain training does."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_pipe.runtime.crossing.skips import routes_line, skip_routes, skips_refusal
from tests.models import SkipNet, fit_plain, loader, plain_trainer
from tests.pipeline import assert_same_weights, fit_pipeline, pipeline_trainer


def test_which_skips_cross_each_boundary_is_decided_from_the_declarations() -> None:
    layers = list(SkipNet().layers)
    assert skip_routes(layers, [3, 3]) == [("a", "b")]
    assert skip_routes(layers, [2, 2, 2]) == [("a", "b"), ("a",)]  # b is popped on stage 1, a goes on
    assert skip_routes(layers, [1, 1, 4]) == [("a",), ("a", "b")]
    assert skip_routes(layers, [6]) == []
    assert routes_line([("a", "b"), ("a",)]) == "; skip connections crossing stages 0 -> 1: a, b; 1 -> 2: a"
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


@pytest.mark.parametrize(
    "processes, options",
    [
        (3, {"schedule": "1f1b", "recompute": "always"}),  # a relayed through stage 1; recomputed with its skips
        (2, {"schedule": "zbv"}),  # 4 stages on 2 processes: a V, a skip between a process's own stages
    ],
    ids=["3p-1f1b-recompute", "2p-zbv"],
)
def test_skips_train_as_plain_through_a_middle_stage_and_a_v_shaped_schedule(processes: int, options: dict) -> None:
    torch.manual_seed(0)
    piped = SkipNet()
    reference = copy.deepcopy(piped)
    fit_plain(reference)
    fit_pipeline(piped, processes, chunks=4, **options)
    assert_same_weights(reference, piped)


def test_a_schedule_that_does_not_carry_skips_is_refused_at_setup() -> None:
    assert skips_refusal("1f1b") is None and skips_refusal("zbv") is None
    message = skips_refusal("pipedream")
    assert message is not None and "schedule='pipedream' does not carry yet" in message
    assert "1f1b" in message and "balance=[...]" in message  # how to fix
    torch.manual_seed(0)
    model = SkipNet()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(Exception, match=r"skip connections across stages .*schedule='chimera' does not carry yet"):
        fit_pipeline(model, 2, schedule="chimera", chunks=4)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


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
