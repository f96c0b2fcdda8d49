from pathlib import Path

import pytest
import torch

from lightning_pipe.recipes.bert import BertMLM, MaskedSequences, TextData, bert_layers
from lightning_pipe.recipes.text import MASK, pack
from tests.recipes.test_text import TEXT


def test_masking_is_a_function_of_the_row_and_the_epoch() -> None:
    """Not of what the process read before: a resumed run (a fresh dataset) masks as an uninterrupted one."""
    rows = pack([list(range(5, 60))] * 4, max_len=16)
    a, b = MaskedSequences(rows, vocab_size=60, seed=3), MaskedSequences(rows, vocab_size=60, seed=3)
    first = [a[i] for i in range(len(rows))]
    assert all(
        torch.equal(x[0], y[0]) and torch.equal(x[2], y[2]) for x, y in zip(first, [b[i] for i in range(len(rows))])
    )
    assert torch.equal(a[0][2], first[0][2])  # read again in the same epoch: the same masking
    a.set_epoch(1)
    second = a[0]
    assert not torch.equal(second[2], first[0][2])  # a new epoch masks differently
    b.set_epoch(1)  # a fresh dataset that starts at epoch 1 (a resume) masks as the one that read epoch 0
    assert torch.equal(b[0][0], second[0]) and torch.equal(b[0][2], second[2])
    masked = torch.stack([MaskedSequences(rows, 60, seed=3 + i)[i % len(rows)][2] for i in range(40)]) != -100
    assert 0.08 < masked.float().mean() < 0.22  # about 15% of (non-special) tokens
    ids, _, labels = a[1]
    assert (ids[labels != -100] == MASK).any()


def test_textdata_on_files_and_the_model(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text((TEXT + "\n\n") * 40)
    data = TextData(source="files", files=[str(path)], vocab_size=40, max_len=16, batch_size=4)
    data.setup()
    ids, mask, labels = next(iter(data.train_dataloader()))
    assert ids.shape == mask.shape == labels.shape == (4, 16)
    model = BertMLM(vocab_size=40, size="tiny", max_len=16)
    assert model(ids, mask).shape == (4, 16, 40)
    assert len(bert_layers(40, "tiny", 16)) == 4  # embeddings, 2 encoder layers, MLM head
    with pytest.raises(ValueError, match="valid sizes: tiny, small, base, large"):
        bert_layers(40, "huge")
    with pytest.raises(ValueError, match="needs recipe.data.files"):
        TextData(source="files")
    with pytest.raises(ValueError, match="bert_mlm masks with its own word tokenizer"):
        TextData(tokenizer="saved").dataset(torch.zeros(2, 16, dtype=torch.long), seed=0)


def test_the_loss_predicts_only_the_masked_positions_and_equals_the_whole_logits_loss() -> None:
    """The head's vocabulary-wide product runs at the masked positions only: the loss and every gradient
    equal those of the logits at every position with the others ignored."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = BertMLM(vocab_size=50, size="tiny", max_len=16, dropout=0.0)
    ids = torch.randint(5, 50, (3, 16))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[2, 12:] = False
    labels = torch.full_like(ids, -100)
    labels[:, ::5] = ids[:, ::5]
    predicted = labels != -100
    assert model(ids, mask, predicted).shape == (int(predicted.sum()), 50)
    model._loss((ids, mask, labels)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(ids, mask)
    whole = F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), ignore_index=-100)
    assert torch.allclose(whole, model._loss((ids, mask, labels)))
    whole.backward()
    for name, parameter in model.named_parameters():
        assert torch.allclose(parameter.grad, grads[name], atol=1e-6), name


def test_decoder_is_tied_to_the_word_embeddings() -> None:
    model = BertMLM(vocab_size=40, size="tiny", max_len=16)
    assert model.layers[-1].decoder.weight is model.layers[0].word.weight
    assert BertMLM(vocab_size=40, max_len=16, tie_embeddings=False).layers[-1].decoder.weight is not None


def test_bert_initialisation_keeps_initial_logits_small() -> None:
    torch.manual_seed(0)
    model = BertMLM(vocab_size=500, size="tiny", max_len=16)
    assert abs(float(model.layers[0].word.weight[5:].std()) - 0.02) < 0.005
    ids = torch.randint(5, 500, (2, 16))
    logits = model(ids, torch.ones_like(ids, dtype=torch.bool))
    assert float(logits.std()) < 1.0  # a loss near ln(vocab) at the start, not far above it


def test_bert_built_in_configure_model_starts_equal_on_two_stages(tmp_path: Path) -> None:
    """The decoder tied to the word embeddings lives on the last stage: it starts from the value the
    first stage's embeddings get, as in a plain run initialised by init_like_pipeline."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe import init_like_pipeline
    from tests.models import SaveStageState, merged_stage_states
    from tests.pipeline import fit_pipeline

    L.seed_everything(3)
    ids = torch.randint(5, 40, (8, 16))
    labels = torch.where(torch.rand(8, 16) < 0.2, ids, torch.full_like(ids, -100))
    data = DataLoader(TensorDataset(ids, torch.ones_like(ids, dtype=torch.bool), labels), batch_size=4)
    kwargs = dict(vocab_size=40, size="tiny", max_len=16, dropout=0.0, build="configure_model")
    fit_pipeline(BertMLM(**kwargs), 2, data, callbacks=[SaveStageState(str(tmp_path), start=True)], max_steps=1)
    start = merged_stage_states(str(tmp_path), 2, start=True)
    plain = BertMLM(**kwargs)
    with torch.device("meta"):
        plain.configure_model()
    expected = init_like_pipeline(plain).state_dict()
    assert set(start) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(start[name], value, rtol=0, atol=0, msg=name)
    assert torch.equal(start["layers.3.decoder.weight"], start["layers.0.word.weight"])


def test_the_recipe_weights_micro_batches_by_their_masked_tokens_and_the_command_line_can_say_otherwise() -> None:
    from lightning_pipe import token_count
    from lightning_pipe.cli import build_strategy
    from tests.test_cli import _compose

    model = BertMLM(vocab_size=64, max_len=16, hidden=32, num_layers=2)
    strategy, _ = build_strategy(_compose(["recipe=bert_mlm"]).strategy, 2, model.strategy_defaults)
    assert strategy.config.loss_weight == token_count(labels=2, shift=False)
    samples = _compose(["recipe=bert_mlm", "strategy.loss_weight=samples"]).strategy
    assert build_strategy(samples, 2, model.strategy_defaults)[0].config.loss_weight == "samples"
    given = _compose(
        ["recipe=bert_mlm", "strategy.loss_weight={_target_:lightning_pipe.token_count,labels:1,shift:true}"]
    )
    assert build_strategy(given.strategy, 2, model.strategy_defaults)[0].config.loss_weight == token_count(labels=1)
