import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pipe import init_like_pipeline
from lightning_pipe.partition.stages.materialize import check_initializable, layer_seed, materialize
from lightning_pipe.recipes.bert import BertMLM
from tests.models import DeferredNet, SaveStageState, merged_stage_states
from tests.pipeline import fit_pipeline

ROOT = Path(__file__).resolve().parents[3]


class Tied(nn.Module):
    """An input projection outside the Sequential, attention, a norm and a head tied to layer 0."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.layers = nn.Sequential(
            nn.Embedding(10, 4), nn.Linear(4, 4), nn.MultiheadAttention(4, 2, batch_first=True), nn.LayerNorm(4),
            nn.BatchNorm1d(4), nn.Linear(4, 10, bias=False),
        )  # fmt: skip
        self.layers[5].weight = self.layers[0].weight


def meta(cls: type = Tied) -> nn.Module:
    with torch.device("meta"):
        return cls()


def test_any_split_materialises_the_same_values_and_nothing_else() -> None:
    whole = init_like_pipeline(meta(), seed=3)
    reference = {k: v.clone() for k, v in whole.state_dict().items()}
    assert torch.equal(reference["layers.0.weight"], reference["layers.5.weight"])
    assert float(reference["layers.2.out_proj.bias"].abs().sum()) == 0.0  # MultiheadAttention's own rule ran last
    for local in ([0, 1], [2, 3], [4, 5], [5], [1, 2, 3, 4], [0, 5]):
        part = meta()
        materialize(part, part.layers, local, "cpu", seed=3)
        held = {k: v for k, v in part.state_dict().items() if not v.is_meta}
        expected = {f"layers.{i}." for i in local}
        assert {k for k in held if k.startswith("layers.")} == {k for k in reference if k.startswith(tuple(expected))}
        assert "embed.weight" in held  # outside the Sequential: everywhere
        for name, value in held.items():
            torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=name)
        if {0, 5} <= set(local):  # the tie survives materialisation
            assert part.layers[5].weight is part.layers[0].weight


def test_seed_changes_the_weights_and_the_rule_is_per_layer() -> None:
    a = init_like_pipeline(meta(), seed=1).state_dict()
    b = init_like_pipeline(meta(), seed=2).state_dict()
    assert not torch.equal(a["layers.1.weight"], b["layers.1.weight"])
    assert layer_seed(1, 0) != layer_seed(1, 1) and layer_seed(1, 0) == layer_seed(1, 0)
    eager = init_like_pipeline(Tied(), seed=1).state_dict()  # an eagerly built module is re-initialised the same way
    for name, value in a.items():
        torch.testing.assert_close(eager[name], value, rtol=0, atol=0, msg=name)


def test_modules_built_eagerly_keep_their_values() -> None:
    """An input projection created in __init__ and layers created on the meta device (as in
    configure_model): only what was on the meta device is initialised."""
    model = Tied()
    embed = model.embed.weight.detach().clone()
    with torch.device("meta"):
        model.layers = Tied().layers
        model.head = nn.Linear(4, 2)  # outside the Sequential too, but on the meta device
    materialize(model, model.layers, [1, 2], "cpu", seed=3)
    assert torch.equal(model.embed.weight, embed)
    assert not model.head.weight.is_meta and float(model.head.weight.abs().sum()) > 0
    reference = init_like_pipeline(meta(), seed=3).state_dict()
    torch.testing.assert_close(model.layers[1].weight, reference["layers.1.weight"], rtol=0, atol=0)


def test_a_module_without_reset_parameters_is_named() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 4), Scale())

    with pytest.raises(
        TypeError, match=r"layers.1 \(Scale\) holds tensors of its own \(gain\).*reset_parameters.*init="
    ):
        check_initializable(meta(Net))
    from lightning_pipe.partition.stages.materialize import Initializer

    check_initializable(meta(Net), Initializer(init=lambda m: None))  # a hook answers for every module


def test_an_init_hook_is_called_on_every_module_seeded_per_layer() -> None:
    """init(module) children before parents; any subset of layers gets the same values; a module the
    hook leaves wholly untouched falls back to its reset_parameters (the LayerNorm: ones)."""
    calls: list[str] = []

    def init(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=3.0)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    whole = init_like_pipeline(meta(), seed=1, init=init)
    assert (
        calls.index("Linear") < calls.index("MultiheadAttention") < calls.index("Tied")
    )  # children first, outside last
    assert 2.5 < float(whole.layers[1].weight.detach().std()) < 3.5
    assert torch.equal(whole.layers[3].weight.detach(), torch.ones(4))  # untouched by the hook: reset_parameters
    part = meta()
    materialize(part, part.layers, [1, 3], "cpu", seed=1, init=init)
    for i in (1, 3):
        torch.testing.assert_close(part.layers[i].weight, whole.layers[i].weight, rtol=0, atol=0)
    with pytest.raises(TypeError, match="give a callable init"):
        materialize(part, part.layers, [0], "cpu", init=3)  # type: ignore[arg-type]


def test_a_tensor_left_unset_is_named_instead_of_training_from_garbage() -> None:
    """Fresh storage starts as NaN: a reset_parameters (or hook) that misses a tensor is caught."""

    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4))
            self.register_buffer("scale", torch.ones(4))

        def reset_parameters(self) -> None:
            nn.init.ones_(self.weight)  # forgets the buffer

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 4), Half())

    with pytest.raises(
        ValueError, match=r"layers.1 \(Half\): its tensors scale are not set by its initialisation.*init="
    ):
        init_like_pipeline(meta(Net), seed=0)
    net = meta(Net)
    materialize(net, net.layers, [0], "cpu", seed=0)  # the layer that is not held is not checked
    assert net.layers[1].scale.is_meta and not bool(net.layers[0].weight.isnan().any())


def test_bert_layers_keep_berts_initialisation() -> None:
    model = BertMLM(vocab_size=50, size="tiny", max_len=16, build="configure_model")
    with torch.device("meta"):
        model.configure_model()
    init_like_pipeline(model, seed=0)
    word = model.layers[0].word.weight
    assert 0.015 < float(word.std()) < 0.025 and float(word[0].abs().sum()) == 0.0  # normal(0, 0.02), padding row 0
    assert model.layers[-1].decoder.weight is word


def test_two_and_four_stages_start_from_the_same_weights(tmp_path: Path) -> None:
    L.seed_everything(7)
    starts = {}
    for stages in (2, 4):
        folder = tmp_path / str(stages)
        folder.mkdir()
        fit_pipeline(DeferredNet(), stages, callbacks=[SaveStageState(str(folder), start=True)], max_steps=1)
        starts[stages] = merged_stage_states(str(folder), stages, start=True)
    plain = DeferredNet()
    with torch.device("meta"):
        plain.configure_model()
    expected = init_like_pipeline(plain).state_dict()  # the seed set above
    assert list(starts[2]) == list(starts[4]) and set(starts[2]) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(starts[2][name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(starts[4][name], value, rtol=0, atol=0, msg=name)


# about 16 s (4 processes); tests/partition/stages/test_hf_large.py bounds a 1 GB model's peak per rank by default
@pytest.mark.slow
def test_no_rank_holds_more_than_half_of_a_model_built_in_configure_model(tmp_path: Path) -> None:
    """4 ranks, a 256 MiB model: each rank's peak resident memory at on_fit_start against the same
    run with a tiny model. Built in configure_model, each rank holds a quarter; built eagerly, each
    rank holds all of it (the measurement sees the whole model when it is there)."""
    script = ROOT / "tests" / "scripts" / "peak_memory.py"
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "--devices", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]

    def peaks(name: str) -> list[int]:
        return [json.loads((tmp_path / name / f"rank{r}.json").read_text())["peak_kb"] * 1024 for r in range(4)]

    model_bytes = 16 * (2048 * 2048 + 2048) * 4
    tiny, deferred, eager = peaks("8-configure_model"), peaks("2048-configure_model"), peaks("2048-eager")
    for rank in range(4):
        assert deferred[rank] - tiny[rank] < model_bytes / 2, (rank, deferred[rank] - tiny[rank])
        assert eager[rank] - tiny[rank] > 0.9 * model_bytes, (rank, eager[rank] - tiny[rank])


def test_a_module_built_under_init_module_empty_init_is_materialised_per_stage(tmp_path: Path) -> None:
    from tests.models import TinyNet
    from tests.pipeline import pipeline_trainer

    L.seed_everything(2)
    trainer = pipeline_trainer(2, callbacks=[SaveStageState(str(tmp_path), start=True)], max_steps=1)
    with trainer.init_module(empty_init=True):
        model = TinyNet()
    assert model.layers[0].weight.is_meta
    from tests.models import loader

    trainer.fit(model, loader())
    start = merged_stage_states(str(tmp_path), 2, start=True)
    with torch.device("meta"):
        plain = TinyNet()
    expected = init_like_pipeline(plain).state_dict()
    assert set(start) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(start[name], value, rtol=0, atol=0, msg=name)
