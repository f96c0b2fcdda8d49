"""What a model's own loss averages over: the default loss weight of a Hugging Face model with a
token-mean loss, the warning where it cannot be decided, and the line for a per-forward MoE loss."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers

from lightning_pipe.runtime.loss_weights import TokenCount
from lightning_pipe.runtime.microbatch import split
from lightning_pipe.runtime.model_losses import (
    default_loss_weight,
    padding_warning,
    per_forward_loss_line,
    token_mean_shift,
)
from tests.hf_models import gpt2, mixtral, vit

LABELS = torch.tensor([[5, 6, 7, -100], [5, -100, -100, -100], [-100, -100, -100, -100], [1, 2, 3, 4]])


def _bert(head: type) -> torch.nn.Module:
    config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=8)  # fmt: skip
    return head(config)


def _t5() -> torch.nn.Module:
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    return transformers.T5ForConditionalGeneration(config)


def test_which_models_losses_are_token_means_and_whether_they_shift() -> None:
    wrapper = torch.nn.Module()
    wrapper.model = gpt2(layers=1)  # the LightningModule's attribute: found inside
    assert token_mean_shift(wrapper) is True
    assert token_mean_shift(_bert(transformers.BertForMaskedLM)) is False
    assert token_mean_shift(_bert(transformers.BertForTokenClassification)) is False
    assert token_mean_shift(_t5()) is False  # seq2seq: the decoder's labels, not shifted
    assert token_mean_shift(_bert(transformers.BertModel)) is None  # no loss of its own: the user's
    assert token_mean_shift(_bert(transformers.BertForSequenceClassification)) is None
    assert token_mean_shift(vit(layers=1)) is None
    two = torch.nn.Module()
    two.a, two.b = gpt2(layers=1), gpt2(layers=1)
    assert token_mean_shift(two) is None  # which one's loss is the step's cannot be told
    assert token_mean_shift(torch.nn.Linear(2, 2)) is None


def test_the_default_counts_the_labels_of_dict_batches_only() -> None:
    ids = torch.zeros_like(LABELS)
    assert default_loss_weight(True, {"input_ids": ids, "labels": LABELS}) == TokenCount("labels", -100, True)
    assert default_loss_weight(False, {"input_ids": ids, "labels": LABELS}) == TokenCount("labels", -100, False)
    assert default_loss_weight(None, {"input_ids": ids, "labels": LABELS}) is None  # not a token-mean model
    assert default_loss_weight(True, (ids, LABELS)) is None  # a tuple: where the labels are is not known
    assert default_loss_weight(True, {"input_ids": ids, "labels": LABELS.float()}) is None  # regression targets


def test_the_padding_warning_names_the_labels_and_only_where_the_shares_differ() -> None:
    ids = torch.ones_like(LABELS)
    why = padding_warning((ids, LABELS), split((ids, LABELS), 4))
    assert why is not None and "token_count(labels=1)" in why and "[3, 1, 0, 4]" in why and "[1, 1, 1, 1]" in why
    assert padding_warning((ids, LABELS), split((ids, LABELS), 2)) is None  # 4 and 4 valid labels: equal shares
    why = padding_warning({"input_ids": ids, "labels": LABELS}, split({"input_ids": ids, "labels": LABELS}, 4))
    assert why is not None and "token_count(labels='labels')" in why
    assert "token_count(labels=None)" in str(padding_warning(LABELS, split(LABELS, 4)))
    full = torch.arange(16).reshape(4, 4)
    assert padding_warning((ids, full), split((ids, full), 2)) is None  # no -100: the shares are the samples'
    even = torch.tensor([[1, -100], [-100, 2], [3, -100], [4, -100]])
    assert padding_warning((ids[:, :2], even), split((ids[:, :2], even), 2)) is None  # padded, equal shares
    assert padding_warning((ids, LABELS), split((ids, LABELS), 1)) is None  # one micro-batch: its mean is plain's


def test_the_per_forward_loss_line_is_for_a_load_balancing_loss_only() -> None:
    line = per_forward_loss_line(mixtral(layers=1, router_logits=True))
    assert line is not None and "MixtralForCausalLM" in line and "once per micro-batch" in line
    assert per_forward_loss_line(mixtral(layers=1)) is None  # output_router_logits off: no such loss
    assert per_forward_loss_line(gpt2(layers=1)) is None
