"""A Hugging Face Llama built in ``configure_model()`` under the pipeline: no rank holds the whole
model (peak memory measured), and the start is HF's initialisation, the same for 2 and 4 stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf_models import LLAMA_1GB, LLAMA_TINY, DeferredLlama, PeakMemory, token_data
from tests.models import SaveStageState, merged_stage_states
from tests.pipeline import fit_pipeline


def test_a_1gb_llama_built_in_configure_model_peaks_below_035x_per_rank_at_4_stages(tmp_path: Path) -> None:
    """284M parameters (1.13 GB in float32): at 4 stages each rank holds 4 blocks, the first also the
    embeddings and the last the head. The resident peak from configure_model to the first step
    (the split, materialisation and HF's initialisation) stays at most 0.35x of the model."""
    import transformers

    with torch.device("meta"):
        whole = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_1GB))
    model_bytes = sum(p.numel() * 4 for p in whole.parameters())
    fit_pipeline(
        DeferredLlama(LLAMA_1GB),
        4,
        token_data(LLAMA_1GB["vocab_size"]),
        module="model.model.layers",
        max_steps=1,
        callbacks=[PeakMemory(str(tmp_path))],
    )
    ranks = [json.loads((tmp_path / f"memory{r}.json").read_text()) for r in range(4)]
    for r, figures in enumerate(ranks):
        assert figures["held"] <= 0.35 * model_bytes, (r, figures, model_bytes)
        assert figures["peak"] <= 0.35 * model_bytes, (r, figures, model_bytes)
    print("model bytes", model_bytes, "per rank", ranks)


def test_the_start_is_the_same_for_2_and_4_stages(tmp_path: Path) -> None:
    starts = {}
    for devices in (2, 4):
        folder = tmp_path / str(devices)
        folder.mkdir()
        torch.manual_seed(0)
        fit_pipeline(
            DeferredLlama(LLAMA_TINY),
            devices,
            token_data(LLAMA_TINY["vocab_size"]),
            module="model.model.layers",
            max_steps=1,
            callbacks=[SaveStageState(str(folder), start=True)],
        )
        starts[devices] = merged_stage_states(str(folder), devices, start=True)
    assert sorted(starts[2]) == sorted(starts[4])
    for name, value in starts[2].items():
        torch.testing.assert_close(starts[4][name], value, rtol=0, atol=0, msg=name)
    # HF's rules: normal(0, 0.02) weights, ones for norms (not PyTorch's defaults)
    assert abs(float(starts[2]["model.model.layers.3.mlp.up_proj.weight"].std()) / 0.02 - 1) < 0.2
    assert torch.equal(starts[2]["model.model.norm.weight"], torch.ones(32))


def test_a_measured_balance_profiles_a_configure_model_llama_and_starts_as_it_would_otherwise(tmp_path: Path) -> None:
    """balance='memory' measures the blocks of a meta-built Llama one temporary copy at a time (the
    modules outside them given storage only while the step runs): the run starts from the same
    weights as a uniform split, and nothing of the profile is left behind."""
    starts = {}
    for balance in ("memory", "uniform"):
        folder = tmp_path / balance
        folder.mkdir()
        torch.manual_seed(0)
        fit_pipeline(
            DeferredLlama(LLAMA_TINY),
            2,
            token_data(LLAMA_TINY["vocab_size"]),
            module="model.model.layers",
            balance=balance,
            max_steps=1,
            callbacks=[SaveStageState(str(folder), start=True)],
        )
        starts[balance] = merged_stage_states(str(folder), 2, start=True)
    assert sorted(starts["memory"]) == sorted(starts["uniform"])
    for name, value in starts["uniform"].items():
        torch.testing.assert_close(starts["memory"][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("devices", [2, 4])
def test_weights_from_a_sharded_save_pretrained_directory_start_a_configure_model_llama(
    tmp_path: Path, devices: int
) -> None:
    """``weights=`` a directory ``save_pretrained(max_shard_size=...)`` wrote in 3 or more shards: the
    stages of a model built in configure_model() start from exactly ``from_pretrained``'s values."""
    import transformers

    config = transformers.LlamaConfig(**{**LLAMA_TINY, "tie_word_embeddings": False}, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "saved", max_shard_size="30KB")
    index = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 3
    expected = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    (tmp_path / "states").mkdir()
    fit_pipeline(
        DeferredLlama({**LLAMA_TINY, "tie_word_embeddings": False}),
        devices,
        token_data(LLAMA_TINY["vocab_size"]),
        module="model.model.layers",
        weights=str(tmp_path / "saved"),
        max_steps=1,
        callbacks=[SaveStageState(str(tmp_path / "states"), start=True)],
    )
    started = merged_stage_states(str(tmp_path / "states"), devices, start=True)
    assert sorted(started) == sorted(f"model.{k}" for k in expected)
    for name, value in expected.items():
        torch.testing.assert_close(started[f"model.{name}"], value, rtol=0, atol=0, msg=name)
