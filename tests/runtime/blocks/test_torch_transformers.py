"""torch's own ``nn.TransformerEncoder``, ``nn.TransformerDecoder`` and ``nn.Transformer`` split by their layers
(``module="encoder.layers"``, ...) train, validate and predict as plain training does, padding masks, a causal
mask and a memory mask included. Their ``forward`` reads ``self.layers[0]`` on every stage to choose torch's
fast path; in validation and prediction (eval mode, no gradient, a padding mask) the encoder's fast path runs,
and its nested hidden state crosses the stages. The predictions include the padding's positions, where the
fast path gives other values than the plain path: equal predictions there say both took the same path."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests.models import fit_plain, plain_trainer
from tests.pipeline import assert_same_weights, fit_pipeline, pipeline_trainer
from tests.torch_transformers import MODULES, TorchTransformerNet, transformer_data


def parity(kind: str, where: str, devices: int = 2, **options: Any) -> None:
    """Fit (6 steps), then validate and predict with the fitted weights, against one process."""
    model_options = {k: options.pop(k) for k in ("layers", "causal", "nested", "norm") if k in options}
    piped = TorchTransformerNet(kind, **model_options)
    reference = copy.deepcopy(piped)
    start = piped.head.weight.detach().clone()
    fit_plain(reference, transformer_data())
    fit_pipeline(piped, devices, transformer_data(), module=MODULES[where], **options)
    assert_same_weights(reference, piped)
    assert not torch.equal(start, piped.head.weight)
    val = transformer_data(16, seed=1)
    expected = plain_trainer().validate(reference, val, verbose=False)[0]["val_loss"]
    got = pipeline_trainer(devices, module=MODULES[where], **options).validate(piped, val, verbose=False)
    assert got[0]["val_loss"] == pytest.approx(expected, rel=1e-5)
    predicted = torch.cat(pipeline_trainer(devices, module=MODULES[where], **options).predict(piped, val))
    torch.testing.assert_close(predicted, torch.cat(plain_trainer().predict(reference, val)))


def test_torch_encoder_with_a_padding_mask_trains_validates_and_predicts_as_plain() -> None:
    """``nn.TransformerEncoder`` with its final ``norm=`` and ``enable_nested_tensor`` left at its default
    (before: ``TransformerEncoderLayer 0 is held by another pipeline stage`` on stage 1, in the first forward)."""
    parity("encoder", "encoder")


def test_torch_decoder_with_causal_memory_and_padding_masks_trains_validates_and_predicts_as_plain() -> None:
    """``nn.TransformerDecoder`` split by its layers, its memory from an encoder that runs on every stage."""
    parity("decoder", "decoder")


@pytest.mark.slow
def test_torch_transformer_split_by_its_encoder_trains_validates_and_predicts_as_plain() -> None:
    """``nn.Transformer``'s encoder layers pipelined, its decoder on the last stage."""
    parity("transformer", "transformer encoder")


@pytest.mark.slow
def test_torch_transformer_split_by_its_decoder_trains_validates_and_predicts_as_plain() -> None:
    """``nn.Transformer``'s decoder layers pipelined, its encoder (fast path in evaluation) on every stage."""
    parity("transformer", "transformer decoder")


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"causal": True, "nested": False, "norm": False},
        {"schedule": "interleaved_1f1b", "layers": 8},
        {"schedule": "zbv", "layers": 8},
    ],
    ids=["causal-no-nested-no-norm", "interleaved", "zbv"],
)
def test_torch_encoder_over_more_stages_and_masks_trains_as_plain(options: dict) -> None:
    """4 processes under 1F1B with a causal mask, ``enable_nested_tensor=False`` and no final norm; 2 processes
    holding 2 stages each (interleaved 1F1B, ZB-V), the nested hidden state crossing within a process too."""
    parity("encoder", "encoder", devices=4 if "schedule" not in options else 2, **options)
