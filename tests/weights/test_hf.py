"""weights= reads what Hugging Face save_pretrained writes, each rank opening only its shards."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import safetensors
import torch
from torch import nn

from lightning_pipe.partition.stages.ends import extended, find_ends
from lightning_pipe.partition.stages.materialize import materialize
from lightning_pipe.weights import check_weights_argument, load_stage_weights, model_spec, open_weights

transformers = pytest.importorskip("transformers")


class Holder(L.LightningModule):
    def __init__(self, build: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.model = build()


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=100, n_positions=16, bos_token_id=0,
                                     eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama(tied: bool) -> Callable[[], nn.Module]:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, tie_word_embeddings=tied,
                                      max_position_embeddings=64, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return lambda: transformers.LlamaForCausalLM(config)


MODELS = {"gpt2": (gpt2, "model.transformer.h"), "llama_untied": (llama(False), "model.model.layers"),
          "llama_tied": (llama(True), "model.model.layers")}  # fmt: skip


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files whose tensor data is opened (safetensors.safe_open), by name."""
    names: list[str] = []
    real = safetensors.safe_open

    def recording(path: str, *args: Any, **kwargs: Any) -> Any:
        names.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", recording)
    return names


def saved(tmp_path: Path, build: Callable[[], nn.Module], shard: str | None) -> tuple[Path, dict[str, torch.Tensor]]:
    """A model saved by save_pretrained (sharded with ``shard``) and what from_pretrained reads back."""
    torch.manual_seed(3)
    model = build()
    directory = tmp_path / "saved"
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    loaded = type(model).from_pretrained(directory)
    return directory, {f"model.{k}": v for k, v in loaded.state_dict().items()}


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_sharded_save_pretrained_directory_loads_as_from_pretrained_on_2_and_4_stages(
    tmp_path: Path, kind: str, opened: list[str]
) -> None:
    """Each "rank" materialises its blocks (and the modules outside them, the embeddings on the first
    and the head on the last) on meta-built copies, as the pipeline does, then
    loads: its tensors equal from_pretrained's, the names found by the prefix 'model.', and it opened
    exactly the shards the index places its tensors in (rank 0 of 4 not the last blocks' shards)."""
    build, path = MODELS[kind]
    directory, expected = saved(tmp_path, build, "40KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 3
    spec = model_spec(Holder(build))
    whole = build()  # a tied tensor is stored under one of its names: the file of each name
    names = {id(t): n for n, t in whole.state_dict(keep_vars=True).items() if n in index}
    stored = {n: names[id(t)] for n, t in whole.state_dict(keep_vars=True).items() if n not in index and id(t) in names}
    for stages in (2, 4):
        seen: set[str] = set()
        for stage, (start, end) in enumerate((s * 4 // stages, (s + 1) * 4 // stages) for s in range(stages)):
            with torch.device("meta"):
                part = Holder(build)
            container = part.get_submodule(path)
            ends = [4] * (stage == 0) + [5] * (stage == stages - 1)  # the embeddings, the head: end stages only
            materialize(
                part, extended(container, find_ends(part, container)), [*range(start, end), *ends], "cpu", seed=0
            )
            opened.clear()
            load_stage_weights(part, directory, spec)
            held = {k: v for k, v in part.state_dict().items() if not v.is_meta}
            assert any(k.startswith(f"{path}.{start}.") for k in held) and not any(
                k.startswith(f"{path}.{end}.") for k in held
            )
            for name, value in held.items():
                torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=f"{stages} stages, {name}")
            files = {index[stored.get(n[len("model.") :], n[len("model.") :])] for n in held}
            assert sorted(opened) == sorted(files), (stages, stage)
            seen |= set(held)
            if stages == 4 and stage == 0:
                assert len(files) < len(set(index.values()))  # not every shard
        assert seen == set(expected)


def test_a_single_file_and_the_tie_stored_once(tmp_path: Path) -> None:
    """model.safetensors without an index; GPT-2's lm_head.weight is not stored (tied) and is
    satisfied by transformer.wte.weight."""
    from lightning_pipe.weights.hf import safetensors_shapes

    directory, expected = saved(tmp_path, gpt2, None)
    assert (directory / "model.safetensors").is_file() and not (directory / "model.safetensors.index.json").exists()
    assert "lm_head.weight" not in safetensors_shapes(directory / "model.safetensors")
    target = Holder(gpt2)
    assert load_stage_weights(target, directory, model_spec(target)) == len(set(map(id, target.parameters())))
    for name, value in target.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    assert target.model.lm_head.weight is target.model.transformer.wte.weight


@pytest.mark.parametrize("shard", [None, 700])
def test_pytorch_model_bin_single_and_sharded(tmp_path: Path, shard: int | None) -> None:
    """pytorch_model.bin and pytorch_model.bin.index.json (as huggingface_hub writes them): the names
    of a Sequential saved alone found under the module's 'layers.' prefix; only needed shards opened."""
    hub = pytest.importorskip("huggingface_hub")
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    hub.save_torch_state_dict(
        layers.state_dict(), tmp_path, safe_serialization=False, **({"max_shard_size": shard} if shard else {})
    )
    assert (tmp_path / ("pytorch_model.bin.index.json" if shard else "pytorch_model.bin")).is_file()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    spec = model_spec(Net())
    with torch.device("meta"):
        part = Net()
    part.layers[4].to_empty(device="cpu")
    source = open_weights(tmp_path)
    assert source.files is not None
    load_stage_weights(part, tmp_path, spec)
    torch.testing.assert_close(part.layers[4].weight, layers[4].weight, rtol=0, atol=0)
    torch.testing.assert_close(part.layers[4].bias, layers[4].bias, rtol=0, atol=0)
    if shard:
        shards = set(source.files.files.values())
        assert len(shards) >= 3
        source.read("4.weight")
        assert source.files.opened == [source.files.files["4.weight"]]


def test_rename_maps_a_custom_layout_and_names_that_do_not_fit_say_so(tmp_path: Path) -> None:
    directory, expected = saved(tmp_path, gpt2, "40KB")

    class Renamed(L.LightningModule):  # the same model under other attribute names
        def __init__(self) -> None:
            super().__init__()
            self.backbone = gpt2().transformer

    target = Renamed()
    spec = model_spec(target)
    expected_error = (
        r"4 names in the file not in the model: transformer.ln_f.bias.*mapped by rename.*rename \(a mapping"
    )
    with pytest.raises(ValueError, match=expected_error) as info:
        load_stage_weights(target, directory, spec, rename={"transformer.h.": "backbone.h."})
    assert "4 names of the model not in the file: backbone.ln_f.bias" in str(info.value)
    for rename in ({"transformer.": "backbone."}, lambda n: "backbone." + n[len("transformer.") :]):
        with torch.no_grad():
            for t in target.parameters():
                t.zero_()
        load_stage_weights(target, directory, spec, rename=rename)
        for name, value in target.state_dict().items():
            torch.testing.assert_close(
                value, expected["model." + name.replace("backbone.", "transformer.")], rtol=0, atol=0
            )


def test_the_argument_accepts_a_save_pretrained_directory_and_damage_is_named(tmp_path: Path) -> None:
    directory, _ = saved(tmp_path, gpt2, "40KB")
    assert check_weights_argument(str(directory)) == directory
    index = directory / "model.safetensors.index.json"
    table = json.loads(index.read_text())
    shard = sorted(set(table["weight_map"].values()))[1]
    (directory / shard).rename(directory / "moved.safetensors")
    with pytest.raises(
        ValueError, match=rf"Cannot read the weights .*saved: .*index.json names shards that are not in .*: {shard}"
    ):
        open_weights(directory)
    (directory / "moved.safetensors").rename(directory / shard)
    good = (directory / shard).read_bytes()
    (directory / shard).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match=rf"Cannot read the weights .*{shard} is not a safetensors file"):
        open_weights(directory)
    (directory / shard).write_bytes(good)
    first = sorted(set(table["weight_map"].values()))[0]
    table["weight_map"]["transformer.extra.weight"] = first
    index.write_text(json.dumps(table))
    with pytest.raises(ValueError, match=rf"places 'transformer.extra.weight' in {first}, which does not hold it"):
        open_weights(directory)


def _bert_classifier() -> nn.Module:
    from tests.hf_families import CLASSES, _bert_config

    return transformers.BertForSequenceClassification(_bert_config(4, num_labels=CLASSES, classifier_dropout=0.0))


def _llama_classifier() -> nn.Module:
    from tests.hf_families import CLASSES, _decoder

    model = _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM)()
    model.config.num_labels = CLASSES
    return transformers.LlamaForSequenceClassification(model.config)


#: a task model, and the base checkpoints it starts from: (what save_pretrained saved, the part of
#: the task model it fills)
FINE_TUNES = {
    "bert": (_bert_classifier, lambda m: transformers.BertModel(m.config), "bert"),
    "llama": (_llama_classifier, lambda m: transformers.LlamaForCausalLM(m.config), ""),
}


@pytest.mark.parametrize("kind", list(FINE_TUNES))
def test_a_base_checkpoint_starts_a_model_with_a_new_head_as_from_pretrained(tmp_path: Path, kind: str) -> None:
    """The common fine-tune: BERT's base model into BertForSequenceClassification, a Llama causal
    LM into LlamaForSequenceClassification. The head the file lacks keeps the model's own
    initialisation, the causal LM's head in the file is left unused, and the run equals plain
    training of the model with the base weights loaded (before: refused as names that do not fit)."""
    from tests.hf_families import BY_NAME, FamilyModule, family_data
    from tests.models import fit_plain
    from tests.pipeline import assert_same_weights, fit_pipeline

    build, base_of, part = FINE_TUNES[kind]
    torch.manual_seed(3)
    base = base_of(build())
    base.save_pretrained(tmp_path / "base")
    torch.manual_seed(0)
    piped = FamilyModule(build, lr=0.01)  # at 0.1 the causal LM's embedding moves by 1.0 and float noise grows to 1e-4
    reference = FamilyModule(build, lr=0.01)
    reference.load_state_dict(piped.state_dict())
    into = reference.model.get_submodule(part) if part else reference.model
    missing, unused = into.load_state_dict(type(base).from_pretrained(tmp_path / "base").state_dict(), strict=False)
    assert (missing, unused) == (([], []) if kind == "bert" else (["score.weight"], ["lm_head.weight"]))
    family = BY_NAME["BERT sequence classification"]  # a class per sequence
    fit_plain(reference, family_data(family))
    fit_pipeline(piped, 2, family_data(family), module=family.module if kind == "bert" else "model.model.layers",
                 weights=str(tmp_path / "base"))  # fmt: skip
    assert_same_weights(reference, piped)


def test_what_a_base_checkpoint_lacks_is_listed_in_one_line_and_a_partial_base_is_refused(tmp_path: Path) -> None:
    from lightning_pipe.weights.load import check_names, match_names
    from tests.hf_families import _bert_config

    transformers.BertForMaskedLM(_bert_config(2)).save_pretrained(tmp_path / "mlm")
    transformers.BertModel(_bert_config(1)).save_pretrained(tmp_path / "short")
    spec = model_spec(Holder(lambda: transformers.BertForSequenceClassification(_bert_config(2, num_labels=3))))
    line = check_names(match_names(open_weights(tmp_path / "mlm"), spec), spec).line(tmp_path / "mlm")
    assert "4 tensors of the model not in the checkpoint" in line and "'model.classifier.weight'" in line
    assert "'model.bert.pooler.dense.weight'" in line  # a part the masked LM does not build
    assert "5 tensors of another head in it are not used: ['model.cls.predictions.bias'" in line
    assert line.count("\n") == 0
    with pytest.raises(ValueError, match=r"not in the file: model\.bert\.encoder\.layer\.1\."):
        check_names(match_names(open_weights(tmp_path / "short"), spec), spec)  # one of 2 blocks: no fit


def test_a_stage_converts_only_its_own_experts(tmp_path: Path) -> None:
    """Mixtral's save_pretrained directory (one tensor per expert and projection): the first of two
    stages, built on the meta device, reads only the file tensors of its own blocks and of the
    embeddings, and its stacked experts equal from_pretrained's."""
    from lightning_pipe.weights.hf import PretrainedFiles
    from tests.hf_models import mixtral

    directory, expected = saved(tmp_path, mixtral, None)
    spec = model_spec(Holder(mixtral))
    read: list[str] = []
    real = PretrainedFiles.read

    def recording(self: PretrainedFiles, name: str) -> torch.Tensor:
        read.append(name)
        return real(self, name)

    with torch.device("meta"):
        part = Holder(mixtral)
    container = part.get_submodule("model.model.layers")
    materialize(part, extended(container, find_ends(part, container)), [0, 1, 4], "cpu", seed=0)  # blocks 0, 1
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PretrainedFiles, "read", recording)
        load_stage_weights(part, directory, spec)
    assert {n.split(".")[2] for n in read if n.startswith("model.layers.")} == {"0", "1"}
    assert any(".experts.3.w1." in n for n in read) and "lm_head.weight" not in read
    stacked = part.model.model.layers[1].mlp.experts.gate_up_proj
    torch.testing.assert_close(stacked, expected["model.model.layers.1.mlp.experts.gate_up_proj"], rtol=0, atol=0)
    held = {k: v for k, v in part.state_dict().items() if not v.is_meta}
    assert not any(k.startswith("model.model.layers.2.") for k in held)
    for name, value in held.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
