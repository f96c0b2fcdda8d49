"""The module's own code around the pipelined call (``configure_optimizers``, ``training_step`` around
``self(x)``, hooks, callbacks): it trains as in plain Lightning, or is refused before any update."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.schedules.traits import TRAITS
from tests.models import TinyNet, fit_plain
from tests.pipeline import assert_same_weights, fit_pipeline


class PositionalGroupsNet(TinyNet):
    """Layer-wise learning rates by position (``list(self.layers)[:4]``, ``enumerate(self.layers)``), plain SGD."""

    def __init__(self, how: str = "slice") -> None:
        super().__init__(optimizer="plain-sgd")
        self.how = how

    def configure_optimizers(self) -> Any:
        if self.how == "slice":  # the Sequential's own slices
            groups = [
                {"params": [p for layer in self.layers[:4] for p in layer.parameters()], "lr": 0.3},
                {"params": [p for layer in self.layers[4:] for p in layer.parameters()], "lr": 0.02},
            ]
        else:  # a rate per position
            groups = [{"params": list(layer.parameters()), "lr": 0.3 / (i + 1)} for i, layer in enumerate(self.layers)]
        return torch.optim.SGD(groups, lr=0.1)


class RecordReads(L.Callback):
    """What each rank's code reads of the split Sequential, at the start of training: ``<folder>/rank<k>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        layers = pl_module.layers
        seen = {
            "len": len(layers),
            "kinds": [type(layer).__name__ for layer in layers],
            "in_features": [getattr(layer, "in_features", None) for layer in layers],
            "last_out": layers[-1].out_features,
            "slice": len(layers[:4]) + len(layers[:]),
            "params_per_layer": [sum(p.numel() for p in layer.parameters()) for layer in layers],
            "names": [n for n, _ in pl_module.named_parameters()],
        }
        with open(Path(self.folder) / f"rank{trainer.global_rank}.json", "w") as f:
            json.dump(seen, f)


@pytest.mark.parametrize("how", ["slice", "enumerate"])
def test_parameter_groups_by_position_train_as_plain(how: str, tmp_path: Path) -> None:
    """Every rank sees the unsplit Sequential's positions: its own layers where it holds them, stand-ins
    without parameters elsewhere, so each parameter gets plain training's learning rate (before: the
    last stage's layers were renumbered from 0 and took the first layers' rates)."""
    torch.manual_seed(0)
    piped = PositionalGroupsNet(how)
    reference = copy.deepcopy(piped)
    fit_plain(reference)
    fit_pipeline(piped, 2, callbacks=[RecordReads(str(tmp_path))])
    assert_same_weights(reference, piped)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    plain_kinds = [type(layer).__name__ for layer in reference.layers]
    for rank, seen in enumerate(ranks):
        mine = range(4) if rank == 0 else range(4, 8)
        assert seen["len"] == 8 and seen["slice"] == 12
        assert seen["kinds"] == [k if i in mine else "HeldLayer" for i, k in enumerate(plain_kinds)]
        assert seen["in_features"] == [getattr(layer, "in_features", None) for layer in reference.layers]
        assert seen["last_out"] == 3
        counts = [sum(p.numel() for p in layer.parameters()) for layer in reference.layers]
        assert seen["params_per_layer"] == [c if i in mine else 0 for i, c in enumerate(counts)]
        assert seen["names"] == [f"layers.{i}.{w}" for i in mine if counts[i] for w in ("weight", "bias")]


class LoopNet(TinyNet):
    """A forward that loops over the Sequential instead of calling it."""

    def __init__(self, numbered: bool = False) -> None:
        super().__init__(optimizer="plain-sgd")
        self.numbered = numbered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.numbered:
            for _, layer in enumerate(self.layers):
                x = layer(x)
            return x
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("numbered, options", [(False, {}), (True, {"module": "layers"}), (False, {"balance": "time"})])
def test_a_forward_looping_over_the_sequential_trains_as_plain(numbered: bool, options: dict[str, Any]) -> None:
    """``for layer in self.layers: x = layer(x)`` (before: refused, "never called the pipelined Sequential";
    the profile of ``balance="time"`` finds the Sequential's input at its first layer)."""
    torch.manual_seed(0)
    piped = LoopNet(numbered)
    reference = copy.deepcopy(piped)
    fit_plain(reference)
    fit_pipeline(piped, 2, **options)
    assert_same_weights(reference, piped)


class LoopVariantNet(TinyNet):
    """Loops that the pipeline cannot run as the unsplit module does."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.variant == "short":  # stops before the last layer
            for layer in self.layers[:-1]:
                x = layer(x)
            return x
        for i, layer in enumerate(self.layers):  # changes the value between layers
            x = layer(x) * 2 if i == 2 else layer(x)
        return x


@pytest.mark.parametrize(
    "variant, message",
    [("short", "stopped after layer 6 of 8"), ("changed", "changed the value between layers 2 and 3")],
)
def test_a_loop_that_is_not_the_sequentials_chain_is_refused_before_any_update(variant: str, message: str) -> None:
    torch.manual_seed(0)
    piped = LoopVariantNet(variant)
    start = copy.deepcopy(piped.state_dict())
    with pytest.raises(Exception, match=message):
        fit_pipeline(piped, 2)
    assert_same_weights(piped, _loaded(LoopVariantNet(variant), start), rtol=0, atol=0)


class HeldWeightPenaltyNet(TinyNet):
    """A loss term on layer 0's weight, read in ``training_step`` (the last stage does not hold it)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y) + 1e-2 * self.layers[0].weight.pow(2).sum()


def test_a_step_reading_another_stages_layer_tensors_is_refused_naming_the_stage() -> None:
    torch.manual_seed(0)
    piped = HeldWeightPenaltyNet()
    start = copy.deepcopy(piped.state_dict())
    with pytest.raises(Exception, match=r"layers\.0 \(Linear, layer 0 of the pipelined Sequential\) is held by "
                       r"pipeline stage 0 of 2: its 'weight' is not on this rank"):  # fmt: skip
        fit_pipeline(piped, 2)
    assert_same_weights(piped, _loaded(HeldWeightPenaltyNet(), start), rtol=0, atol=0)


def _loaded(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    model.load_state_dict(state)
    return model


class LayerDecayBert(L.LightningModule):
    """Layer-wise learning-rate decay over a BERT's blocks (``enumerate(self.bert.encoder.layer)``), plain SGD."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)  # fmt: skip
        self.bert = transformers.BertModel(config, add_pooling_layer=False)
        self.classifier = nn.Linear(32, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.bert(input_ids=ids).last_hidden_state[:, 0])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return F.cross_entropy(self(ids), labels[:, 0] % 3)

    def configure_optimizers(self) -> Any:
        blocks = self.bert.encoder.layer
        groups = [
            {"params": list(b.parameters()), "lr": 0.4 * 0.5 ** (len(blocks) - 1 - i)} for i, b in enumerate(blocks)
        ]
        inside = {id(p) for group in groups for p in group["params"]}
        groups.append({"params": [p for p in self.parameters() if id(p) not in inside], "lr": 0.4})
        return torch.optim.SGD(groups, lr=0.4)


def test_layer_wise_learning_rate_decay_over_a_block_container_trains_as_plain() -> None:
    """Before: refused, the container's loop outside the steps raised "it runs inside the Trainer's steps"."""
    pytest.importorskip("transformers")
    from tests.hf_models import data_for

    torch.manual_seed(0)
    piped = LayerDecayBert()
    reference = copy.deepcopy(piped)
    fit_plain(reference, data_for("bert"), max_steps=4)
    fit_pipeline(piped, 2, data_for("bert"), module="bert.encoder.layer", max_steps=4)
    assert_same_weights(reference, piped)


def _l1(p: torch.Tensor) -> torch.Tensor:
    return 2e-2 * p.abs().sum()


class PenaltyNet(TinyNet):
    """Learning rates by position, and an L1 penalty over every parameter: in the loss (``"loss"``, what
    plain training writes), or as :func:`lightning_pipe.parameter_penalty` (``"optimizer"``)."""

    def __init__(self, where: str) -> None:
        super().__init__(optimizer="plain-sgd")
        self.where = where

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.where == "loss":
            loss = loss + sum(_l1(p) for p in self.parameters())
        return loss

    def configure_optimizers(self) -> Any:
        groups = [{"params": list(layer.parameters()), "lr": 0.3 / (i + 1)} for i, layer in enumerate(self.layers)]
        optimizer = torch.optim.SGD(groups, lr=0.1)
        if self.where == "optimizer":
            from lightning_pipe import parameter_penalty

            return parameter_penalty(optimizer, _l1)
        return optimizer


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_a_penalty_over_parameters_as_parameter_penalty_equals_plain_training_with_it_in_the_loss(
    schedule: str,
) -> None:
    """Each stage adds its own parameters' part of the penalty's gradient: the weights equal plain
    training's with the penalty added to the loss."""
    torch.manual_seed(0)
    reference = PenaltyNet("loss")
    piped = copy.deepcopy(reference)
    piped.where = "optimizer"
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule=schedule)
    assert_same_weights(reference, piped)
    torch.manual_seed(0)
    unpenalized = PenaltyNet("none")
    fit_plain(unpenalized)
    assert not torch.allclose(unpenalized.layers[0].weight, piped.layers[0].weight, atol=1e-3)  # the term counts


def test_a_penalty_over_parameters_in_the_loss_is_refused_before_any_update() -> None:
    """Before: the last stage's loss covered its own layers only (4.5e-3 from plain for an L2 term)."""
    torch.manual_seed(0)
    piped = PenaltyNet("loss")
    start = copy.deepcopy(piped.state_dict())
    read = r"reads parameters of the pipelined layers other than through the pipelined call \(layers\.4\.weight, "
    with pytest.raises(Exception, match=rf"The step's loss {read}layers\.4\.bias, .*lightning_pipe\.parameter_penalty"):
        fit_pipeline(piped, 2)
    assert_same_weights(piped, _loaded(PenaltyNet("loss"), start), rtol=0, atol=0)


class HookedNet(TinyNet):
    """Intermediate supervision: a forward hook on layer 1 keeps its output, which the loss reads."""

    def __init__(self) -> None:
        super().__init__(optimizer="plain-sgd")
        self.features: torch.Tensor | None = None
        self.probe = nn.Linear(8, 3)
        self.layers[1].register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.features = output

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.features is not None:
            loss = loss + 0.5 * F.cross_entropy(self.probe(self.features), y)
        return loss


def test_a_forward_hook_on_another_stages_layer_read_by_the_loss_is_refused_before_any_update() -> None:
    """Before: the hook ran on stage 0 and the last stage's loss dropped its term (0.011 from plain)."""
    torch.manual_seed(0)
    piped = HookedNet()
    start = copy.deepcopy(piped.state_dict())
    with pytest.raises(Exception, match=r"A forward hook is registered on a layer of the pipelined Sequential that "
                       r"another stage holds \(HookedNet\._keep on layers\.1 \(Tanh, layer 1 of the pipelined "
                       r"Sequential\) is held by pipeline stage 0 of 2\)"):  # fmt: skip
        fit_pipeline(piped, 2)
    fresh = HookedNet()
    fresh.load_state_dict(start)
    assert_same_weights(piped, fresh, rtol=0, atol=0)


def test_stochastic_weight_averaging_trains_as_plain() -> None:
    """Lightning's callback copies the module before the split: copied again after it (before: a size
    mismatch, 16 against 4, averaging the tensors of different layers)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    torch.manual_seed(0)
    piped = TinyNet(optimizer="plain-sgd")
    reference = copy.deepcopy(piped)
    swa = {"swa_lrs": 0.05, "swa_epoch_start": 1}
    fit_plain(reference, max_steps=-1, max_epochs=3, callbacks=[StochasticWeightAveraging(**swa)])
    fit_pipeline(piped, 2, max_steps=-1, max_epochs=3, callbacks=[StochasticWeightAveraging(**swa)])
    assert_same_weights(reference, piped)
    torch.manual_seed(0)
    unaveraged = TinyNet(optimizer="plain-sgd")
    fit_plain(unaveraged, max_steps=-1, max_epochs=3)
    assert not torch.allclose(unaveraged.layers[0].weight, piped.layers[0].weight, atol=1e-3)  # the average counts


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule", [s for s in TRAITS if not TRAITS[s].asynchronous and s not in ("1f1b", "zero_bubble")]
)
def test_positional_groups_and_a_parameter_penalty_train_as_plain_under_every_synchronous_schedule(
    schedule: str,
) -> None:
    """Learning rates by position and ``parameter_penalty``: several stages per process (interleaved, the
    V shapes) and Chimera's copies too."""
    torch.manual_seed(0)
    reference = PenaltyNet("loss")
    piped = copy.deepcopy(reference)
    piped.where = "optimizer"
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule=schedule, chunks=4)
    assert_same_weights(reference, piped)


class RecordingNet(TinyNet):
    """Intermediate supervision written with ``lightning_pipe.recording`` and ``recorded``: a probe loss on
    layer 1's output, which the last stage receives with the micro-batch."""

    def __init__(self) -> None:
        super().__init__(optimizer="plain-sgd")
        from lightning_pipe import recording

        self.probe = nn.Linear(8, 3)
        self.layers[1].register_forward_hook(recording("features"))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        from lightning_pipe import recorded

        x, y = batch
        return F.cross_entropy(self(x), y) + 0.5 * F.cross_entropy(self.probe(recorded("features")), y)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_a_recording_hook_read_by_the_loss_trains_as_plain(schedule: str) -> None:
    """The recorded value crosses from stage 0 to the last stage, its gradient back to layers 0 and 1."""
    torch.manual_seed(0)
    piped = RecordingNet()
    reference = copy.deepcopy(piped)
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule=schedule, chunks=4)
    assert_same_weights(reference, piped)
    torch.manual_seed(0)
    unprobed = TinyNet(optimizer="plain-sgd")
    fit_plain(unprobed)
    assert not torch.allclose(unprobed.layers[0].weight, piped.layers[0].weight, atol=1e-3)  # the probe counts
