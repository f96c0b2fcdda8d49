"""Each micro-batch's share of the batch's loss: samples, or the tokens a language model's loss averages over."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe import PipelineStrategy, token_count
from lightning_pipe.config import PipelineConfig
from lightning_pipe.runtime.loss_weights import microbatch_weights
from lightning_pipe.runtime.microbatch import split

LABELS = torch.tensor([[5, 6, 7, -100], [5, -100, -100, -100], [-100, -100, -100, -100], [1, 2, 3, 4]])


def test_token_count_finds_the_labels_in_dicts_tuples_and_plain_tensors() -> None:
    ids = torch.zeros_like(LABELS)
    assert int(token_count()({"input_ids": ids, "labels": LABELS})) == 2 + 0 + 0 + 3  # shifted: the first is no target
    assert int(token_count(labels=1, shift=False)((ids, LABELS))) == 3 + 1 + 0 + 4
    assert int(token_count(labels=None, ignore_index=5, shift=False)(LABELS)) == 16 - 2
    with pytest.raises(ValueError, match=r"token_count\(labels='labels'\): found no label tensor .* keys \['ids'\]"):
        token_count()({"ids": ids})
    with pytest.raises(TypeError, match="give a key"):
        token_count(labels=1.5)  # type: ignore[arg-type]


def test_shares_of_the_batchs_tokens_and_a_microbatch_without_any() -> None:
    micro = split((torch.zeros_like(LABELS), LABELS), 4)
    assert microbatch_weights(micro, token_count(labels=1, shift=False)) == [3 / 8, 1 / 8, 0.0, 4 / 8]
    assert microbatch_weights(micro, None) == [0.25] * 4  # samples
    assert microbatch_weights(micro[2:3], token_count(labels=1)) == [0.0]  # no token at all: a NaN mean, as plain
    with pytest.raises(ValueError, match="loss_weight gave -1 for micro-batch 0 of 4"):
        microbatch_weights(micro, lambda mb: -1)


def test_the_argument_takes_a_callable_or_samples() -> None:
    assert PipelineConfig(loss_weight="samples").loss_weight == "samples"  # kept: the samples, said, never a default
    counted = PipelineStrategy(loss_weight=token_count(labels=1), start_method="fork").config.loss_weight
    assert counted == token_count(labels=1)
    with pytest.raises(ValueError, match=r"PipelineStrategy\(loss_weight='tokens'\): give a callable"):
        PipelineConfig(loss_weight="tokens")
