"""LoRA through peft: a wrapped model split by its own path (``module="model.model.layers"``, as without the
wrapper) or by the wrapper's whole path trains as plain training, the frozen base untouched."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from lightning_pipe.partition.stages.split import find_sequential, registered_path  # noqa: E402
from tests.hf_models import HFModule, llama, token_data  # noqa: E402
from tests.models import fit_plain  # noqa: E402
from tests.pipeline import assert_same_weights, fit_pipeline  # noqa: E402


def _lora() -> torch.nn.Module:
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(llama(False), config)


def test_the_models_own_path_names_the_blocks_through_the_wrapper() -> None:
    module = HFModule(_lora)
    whole = "model.base_model.model.model.layers"
    assert registered_path(module, "model.model.layers") == whole
    assert registered_path(module, whole) == whole
    assert find_sequential(module, "model.model.layers") == (whole, module.model.base_model.model.model.layers)
    with pytest.raises(ValueError, match="has no attribute 'blocks'"):
        find_sequential(module, "model.model.blocks")


@pytest.mark.parametrize("path", ["model.model.layers", "model.base_model.model.model.layers"])
def test_lora_trains_as_plain_training_and_leaves_the_base_alone(path: str) -> None:
    torch.manual_seed(0)
    plain, piped = HFModule(_lora), HFModule(_lora)
    piped.load_state_dict(plain.state_dict())
    start = {n: p.detach().clone() for n, p in piped.named_parameters() if not p.requires_grad}
    vocab = plain.model.config.vocab_size
    fit_plain(plain, token_data(vocab), max_steps=3)
    fit_pipeline(piped, 2, token_data(vocab), max_steps=3, module=path, chunks=2)
    assert_same_weights(plain, piped)
    frozen = dict(piped.named_parameters())
    assert start and all(torch.equal(frozen[n], v) for n, v in start.items())  # the base is bit-identical
    lora = [n for n, p in piped.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n in lora)
