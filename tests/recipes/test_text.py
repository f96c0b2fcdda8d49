"""The text recipes' corpus, tokenizer and rows."""

from pathlib import Path

import pytest
import torch

from lightning_pipe.recipes.text import CLS, SEP, SPECIALS, WordTokenizer, file_documents, pack, stdlib_documents

TEXT = """The quick brown fox jumps over the lazy dog. It was the best of times.

A second paragraph, with words the first one did not use: pipeline stages send activations.

Third: the fox again, and the dog again."""


def test_file_loader_and_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    documents = file_documents([str(path)])
    assert len(documents) == 3 and documents[1].startswith("A second paragraph")
    tokenizer = WordTokenizer.build(documents, vocab_size=20)
    assert len(tokenizer) == 20 and tokenizer.vocab[: len(SPECIALS)] == SPECIALS
    ids = tokenizer.encode("the fox zebra")
    assert tokenizer.decode(ids) == "the fox [UNK]"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        file_documents([str(tmp_path / "missing.txt")])


def test_stdlib_corpus_is_real_english() -> None:
    documents = stdlib_documents(limit_chars=50_000)
    text = " ".join(documents).lower()
    assert len(text) >= 50_000
    for word in (" the ", " of ", " return", " function"):
        assert word in text


def test_pack_cuts_the_stream_into_rows_with_their_ends() -> None:
    rows = pack([[10, 11, 12], [13, 14]], max_len=5)
    assert rows.tolist() == [[CLS, 10, 11, 12, SEP], [CLS, SEP, 13, 14, SEP]]  # [SEP] after each document
    rows = pack([[10, 11, 12], [13, 14]], max_len=4, first=7, last=9)
    assert rows.tolist() == [[7, 10, 11, 9], [7, 12, 9, 9], [7, 13, 14, 9]]
    with pytest.raises(ValueError, match="fewer than one sequence of 16"):
        pack([[10, 11]], max_len=16)
    assert torch.equal(pack([list(range(5, 20))], 8)[:, 0], torch.full((2,), CLS))
