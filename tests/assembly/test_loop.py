"""``PlainPipeline``'s verbs in one process (a gloo world of one holding both stages of an interleaved split):
the gradients ``loss.backward()`` would add, the loss of the whole batch, evaluation without gradients, and a
save that consolidates to the module's weights and loads back."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import lightning_pipe
from lightning_pipe.checkpoint import consolidate
from lightning_pipe.runtime.topology import Topology
from tests.assembly.plain_runs import Net, batches, loss_fn


@pytest.fixture
def reference() -> Net:
    return Net(depth=4)


def test_a_train_step_adds_the_plain_gradients_and_returns_the_batch_loss(
    world_of_one: Topology, reference: Net
) -> None:
    batch = batches()[0]
    loss = loss_fn(reference)(batch)
    loss.backward()
    model = Net(depth=4)
    with lightning_pipe.build_pipeline(model, schedule="interleaved_1f1b", chunks=3) as pipe:
        assert sorted(pipe.pipeline.stages) == [0, 1]  # both stages of the split on this process
        got = pipe.train_step(batch, loss_fn(model))
        torch.testing.assert_close(got, loss.detach())
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
        pipe.train_step(batch, loss_fn(model))  # no zero_grad between: added, as backward adds
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, 2 * q.grad)
        norm = pipe.clip_grad_norm_(0.01)
        expected = torch.stack([torch.linalg.vector_norm(2 * q.grad) for q in reference.parameters()]).norm()
        torch.testing.assert_close(norm, expected)
        total = torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]).norm()
        torch.testing.assert_close(total, torch.tensor(0.01), rtol=1e-4, atol=1e-6)  # clipped to max_norm


def test_evaluation_runs_without_gradients(world_of_one: Topology, reference: Net) -> None:
    batch = batches()[1]
    model = Net(depth=4)
    with lightning_pipe.build_pipeline(model, schedule="1f1b", chunks=4) as pipe:
        got = pipe.evaluate(batch, loss_fn(model))
        assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(got, loss_fn(reference)(batch))


def test_a_save_consolidates_to_the_module_and_loads_back(world_of_one: Topology, tmp_path: Path) -> None:
    model = Net(depth=4)
    with lightning_pipe.build_pipeline(model, schedule="interleaved_1f1b", chunks=2) as pipe:
        optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
        pipe.train_step(batches()[0], loss_fn(model))
        optimizer.step()
        pipe.save(tmp_path / "checkpoint", [optimizer], global_step=1)
        saved = copy.deepcopy(model.state_dict())
    consolidated = consolidate(tmp_path / "checkpoint")
    torch.testing.assert_close(consolidated["state_dict"], saved)
    assert consolidated["global_step"] == 1 and len(consolidated["optimizer_states"]) == 1
    again = Net(depth=4)
    with lightning_pipe.build_pipeline(again, schedule="1f1b") as pipe:  # another schedule reads it too
        fresh = torch.optim.Adam(pipe.parameters(), lr=0.01)
        assert pipe.load(tmp_path / "checkpoint", [fresh])["global_step"] == 1
    torch.testing.assert_close(again.state_dict(), saved)
    assert fresh.state_dict()["state"][0]["step"] == 1  # Adam's moments came back too


def test_a_rule_that_follows_the_optimizer_asks_for_it_before_training(world_of_one: Topology) -> None:
    model = Net(depth=4)
    with lightning_pipe.build_pipeline(model, schedule="pipemare", chunks=2) as pipe:
        with pytest.raises(RuntimeError, match=r"call pipe.attach_optimizers\(optimizer\)"):
            pipe.train_step(batches()[0], loss_fn(model))
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        pipe.attach_optimizers(optimizer)
        assert torch.isfinite(pipe.train_step(batches()[0], loss_fn(model)))
        optimizer.step()
