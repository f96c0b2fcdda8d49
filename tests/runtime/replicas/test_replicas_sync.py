"""``replicas_sync="elastic"``: 2 stages x 2 replicas that each step on their own batches and are
pulled together with a center variable every ``replicas_sync_period`` steps, against the same rule run by
hand in one process on two copies of the model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe import PipelineStrategy
from tests.models import TinyNet, loader
from tests.pipeline import assert_same_weights, fit_pipeline
from tests.runtime.replicas.test_data_parallel import _CountAllReduce


def elastic_reference(
    model: TinyNet, replicas: int, steps: int, period: int, alpha: float, batch: int = 12
) -> tuple[list[TinyNet], dict[str, torch.Tensor]]:
    """The rule in plain PyTorch: ``replicas`` copies of ``model``, copy j reading samples j, j + d, ...
    (as the replicas' sampler gives them) in batches of ``batch``, each with its own SGD; after every
    ``period``-th step: d_i = x_i - c, x_i -= alpha d_i, c += alpha sum_i d_i. Returns the copies and c."""
    data = loader().dataset
    copies = [copy.deepcopy(model) for _ in range(replicas)]
    optimizers = [c.configure_optimizers() for c in copies]
    center = {n: p.detach().clone() for n, p in model.named_parameters()}
    parts = [list(range(j, len(data), replicas)) for j in range(replicas)]
    per_epoch = -(-len(parts[0]) // batch)
    for step in range(steps):
        first = (step % per_epoch) * batch
        for replica, (net, optimizer) in enumerate(zip(copies, optimizers)):
            x, y = data[parts[replica][first : first + batch]]
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
        if (step + 1) % period == 0:
            with torch.no_grad():
                for name in center:
                    diffs = [dict(net.named_parameters())[name] - center[name] for net in copies]
                    for net, diff in zip(copies, diffs):
                        dict(net.named_parameters())[name].sub_(alpha * diff)
                    center[name] += alpha * torch.stack(diffs).sum(0)
    return copies, center


class _RecordReplicas(L.Callback):
    """Each rank's trained parameters and center variable, by name, at the end of the fit."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        elastic = trainer.strategy.pipeline.elastic
        record = {
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "center": dict(zip(elastic.names, [c.clone() for c in elastic.center])),
        }
        torch.save(record, Path(self.folder) / f"replica{trainer.global_rank}.pt")


@pytest.mark.parametrize(
    "schedule, order",
    [("1f1b", [1, 0, 3, 2]), pytest.param("gpipe", None, marks=pytest.mark.slow)],
    ids=["1f1b-rank-0-in-replica-1", "gpipe"],
)
def test_elastic_replicas_follow_the_rule_and_all_reduce_only_when_they_average(
    tmp_path: Path, schedule: str, order: list[int] | None
) -> None:
    """Six steps, a pull every second one (alpha 0.45): every rank's weights and center equal the
    single-process rule's; replica 0 comes back to this process, also where ``rank_order`` puts rank 0
    in replica 1 (``[1, 0, 3, 2]``: ranks 1 and 3 are replica 0's stages); the stage's replicas
    all-reduce nothing in the steps between pulls and the stage's parameters once in each pull's step."""
    torch.manual_seed(0)
    model = TinyNet()
    copies, center = elastic_reference(model, replicas=2, steps=6, period=2, alpha=0.45)
    piped = copy.deepcopy(model)
    callbacks = [_RecordReplicas(str(tmp_path)), _CountAllReduce(str(tmp_path))]
    fit_pipeline(
        piped, 4, data=loader(batch_size=12), stages=2, chunks=3, schedule=schedule, replicas_sync="elastic",
        replicas_sync_period=2, rank_order=order, callbacks=callbacks,
    )  # fmt: skip
    assert_same_weights(copies[0], piped)
    replica_of = [1, 0, 1, 0] if order else [0, 1, 0, 1]  # slot k (stage k // 2 of replica k % 2) is rank order[k]
    for rank in range(4):
        record = torch.load(tmp_path / f"replica{rank}.pt", weights_only=True)
        reference = dict(copies[replica_of[rank]].named_parameters())
        assert record["params"] and set(record["params"]) == set(record["center"])
        for name, value in record["params"].items():
            torch.testing.assert_close(value, reference[name].detach(), rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(record["center"][name], center[name], rtol=1e-4, atol=1e-6, msg=name)
        counted = json.loads((tmp_path / f"bytes{rank}.json").read_text())
        assert counted["steps"] == [0, counted["params"]] * 3, (rank, counted)
    first = dict(copies[0].named_parameters())
    assert any((first[n] - p).abs().max() > 1e-3 for n, p in copies[1].named_parameters())  # they differ


@pytest.mark.slow
def test_elastic_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    """A save after 3 steps (between two pulls, period 2) and a resume to 6 give each replica its own
    weights, momentum and center back: the same weights, bit for bit, as 6 steps straight."""
    options = dict(stages=2, chunks=3, replicas_sync="elastic", replicas_sync_period=2)
    torch.manual_seed(0)
    initial = TinyNet().state_dict()
    nets = []
    for _ in range(3):
        net = TinyNet()
        net.load_state_dict(initial)
        nets.append(net)
    straight, first, resumed = nets
    fit_pipeline(straight, 4, data=loader(batch_size=12), callbacks=[_RecordReplicas(str(tmp_path))], **options)
    records = [torch.load(tmp_path / f"replica{r}.pt", weights_only=True) for r in range(4)]
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=3)
    fit_pipeline(
        first, 4, data=loader(batch_size=12), max_steps=3, enable_checkpointing=True, callbacks=[ckpt], **options
    )
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt" / "stage-00000.pt", weights_only=True)["extra"]["elastic"]
    assert saved["steps"] == 3 and len(saved["own"]) == 2 and saved["center"]
    fit_pipeline(
        resumed, 4, data=loader(batch_size=12), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
        callbacks=[_RecordReplicas(str(tmp_path))], **options,
    )  # fmt: skip
    assert_same_weights(straight, resumed, rtol=0, atol=0)
    for rank in range(4):  # replica 1's weights and every center too
        again = torch.load(tmp_path / f"replica{rank}.pt", weights_only=True)
        for key in ("params", "center"):
            for name, value in records[rank][key].items():
                assert torch.equal(value, again[key][name]), (rank, key, name)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"replicas_sync": "gossip"}, "replicas_sync='gossip'.*allreduce, elastic"),
        ({"replicas_sync_period": 4}, "replicas_sync_period=...*replicas_sync='allreduce'"),
        ({"replicas_sync": "elastic", "replicas_sync_period": 0}, "replicas_sync_period=0"),
        ({"replicas_sync": "elastic", "replicas_sync_alpha": 1.5}, "replicas_sync_alpha=1.5"),
        ({"replicas_sync": "elastic", "data_parallel": "shard"}, "data_parallel='shard'"),
        ({"replicas_sync": "elastic", "schedule": "pipedream_2bw"}, "synchronous schedules"),
    ],
)
def test_elastic_refuses_bad_arguments(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineStrategy(**arguments)


@pytest.mark.parametrize(
    "devices, stages, alpha, message",
    [(2, 2, None, "this run has 1 replica"), (4, 2, 0.6, r"replicas x alpha = 1.2 > 1")],
)
def test_elastic_refuses_a_layout_it_cannot_average_before_launch(
    devices: int, stages: int, alpha: float | None, message: str
) -> None:
    strategy = PipelineStrategy(stages=stages, replicas_sync="elastic", replicas_sync_alpha=alpha, start_method="fork")
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False)
    with pytest.raises(ValueError, match=message):
        trainer.fit(TinyNet(), loader())


def test_elastic_refuses_a_gradient_scaler() -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_pipe.assembly.refusals import check_elastic_scaler
    from lightning_pipe.trainer.compatibility import as_misconfiguration

    check_elastic_scaler("elastic", None)
    check_elastic_scaler("allreduce", torch.amp.GradScaler("cpu"))
    with pytest.raises(MisconfigurationException, match="16-mixed"), as_misconfiguration():  # as the Trainer sees it
        check_elastic_scaler("elastic", torch.amp.GradScaler("cpu"))


def test_the_command_line_composes_elastic_averaging() -> None:
    from lightning_pipe.cli import build_strategy, check_keys
    from tests.test_cli import _compose

    overrides = [
        "strategy.replicas_sync=elastic",
        "strategy.replicas_sync_period=8",
        "strategy.replicas_sync_alpha=0.2",
    ]
    cfg = _compose(["strategy=gpipe", "strategy.stages=2", *overrides])
    check_keys(cfg)
    config = build_strategy(cfg.strategy, 4)[0].config
    assert (config.schedule, config.replicas_sync, config.replicas_sync_period, config.replicas_sync_alpha) == (
        "gpipe", "elastic", 8, 0.2,
    )  # fmt: skip
    assert build_strategy(_compose([]).strategy, 2)[0].config.replicas_sync == "allreduce"
