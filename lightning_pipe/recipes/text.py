"""English text offline, a tokenizer built from it, and the rows a language model trains on: what
the text recipes (``bert_mlm``, ``llama``) share.

Text sources:

- ``stdlib`` (default): the docstrings of the Python standard library installed with the running
  interpreter, read with ``ast`` (nothing is imported or downloaded): several MB of English.
- ``files``: the user's own text files (``files=[a.txt, b.txt]``); blank lines separate documents.

The tokenizer is built locally from the training text: lower-cased words and punctuation, the most
frequent ``vocab_size - 5`` of them, plus ``[PAD] [UNK] [CLS] [SEP] [MASK]``; or it is the
``transformers`` tokenizer saved in a directory (``tokenizer=``, the ``hf`` extra), with its own
begin and end tokens. The documents' tokens are concatenated, ``[SEP]`` after each, and cut into
rows of ``max_len`` that start with ``[CLS]`` and end with ``[SEP]``: no padding.
"""

from __future__ import annotations

import ast
import math
import re
import sysconfig
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.recipes import TrainValData, require_transformers

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD, UNK, CLS, SEP, MASK = range(5)
SOURCES = ("stdlib", "files")
_WORD = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")


def stdlib_documents(limit_chars: int | None = None) -> list[str]:
    """Docstrings of the installed Python standard library, one document each (module, class or
    function docstrings of at least 200 characters), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    documents: list[str] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if any(part in ("test", "tests", "idlelib", "site-packages", "lib2to3") for part in path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    documents.append(" ".join(doc.split()))
                    total += len(documents[-1])
                    if limit_chars is not None and total >= limit_chars:
                        return documents
    if not documents:
        raise RuntimeError(f"No docstrings found under {root}; use recipe.data.source=files with your own text.")
    return documents


def file_documents(files: Sequence[str]) -> list[str]:
    """Documents from text files: paragraphs separated by blank lines."""
    documents: list[str] = []
    for name in files:
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"recipe.data.files: {path} does not exist")
        for paragraph in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
            text = " ".join(paragraph.split())
            if text:
                documents.append(text)
    if not documents:
        raise ValueError(f"recipe.data.files {list(files)} hold no text")
    return documents


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class WordTokenizer:
    """Word-level tokenizer with a vocabulary built from the corpus."""

    def __init__(self, vocab: Sequence[str]) -> None:
        self.vocab = list(vocab)
        self.index = {w: i for i, w in enumerate(self.vocab)}

    @classmethod
    def build(cls, documents: Iterable[str], vocab_size: int) -> WordTokenizer:
        counts: Counter[str] = Counter()
        for doc in documents:
            counts.update(words(doc))
        common = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - len(SPECIALS)]
        return cls(SPECIALS + [w for w, _ in common])

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return [self.index.get(w, UNK) for w in words(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.vocab[i] for i in ids)


def pack(token_lists: Iterable[list[int]], max_len: int, first: int = CLS, last: int = SEP) -> torch.Tensor:
    """Concatenate the documents' tokens, ``last`` after each, and cut them into rows of
    ``max_len``: ``first``, the tokens, ``last``."""
    body = max_len - 2
    stream: list[int] = []
    for tokens in token_lists:
        stream.extend(tokens)
        stream.append(last)
    rows = len(stream) // body
    if rows == 0:
        raise ValueError(f"the corpus has {len(stream)} tokens, fewer than one sequence of {max_len}")
    data = torch.tensor(stream[: rows * body], dtype=torch.long).view(rows, body)
    return torch.cat([torch.full((rows, 1), first), data, torch.full((rows, 1), last)], dim=1)


def saved_tokenizer(directory: str) -> tuple[Any, int, int]:
    """The ``transformers`` tokenizer saved in ``directory`` (read from disk only), and the ids that
    begin and end a row: its begin-of-text token (its end-of-text one when it has none) and its
    end-of-text token, which also separates documents."""
    path = str(Path(directory).expanduser())
    tokenizer = require_transformers("recipe.data.tokenizer").AutoTokenizer.from_pretrained(path, local_files_only=True)
    last = tokenizer.eos_token_id
    if last is None:
        raise ValueError(f"recipe.data.tokenizer={path}: the tokenizer has no end-of-text token to separate documents.")
    return tokenizer, tokenizer.bos_token_id if tokenizer.bos_token_id is not None else last, last


class CorpusData(TrainValData):
    """The documents of ``source``, tokenized and packed into rows of ``max_len``, the first
    ``val_fraction`` of them held out for validation. A recipe says what a row becomes
    (:meth:`dataset`) and may tokenize otherwise (:meth:`rows`)."""

    def __init__(
        self,
        source: str = "stdlib",
        files: Sequence[str] | None = None,
        vocab_size: int = 8000,
        max_len: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.02,
        limit_chars: int | None = 3_000_000,
        seed: int = 0,
        num_workers: int = 0,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"recipe.data.source={source!r}: valid sources are 'stdlib' and 'files'.")
        if source == "files" and not files:
            raise ValueError("recipe.data.source=files needs recipe.data.files=[path, ...]")
        self.source, self.files = source, list(files or [])
        self.vocab_size, self.max_len, self.batch_size = vocab_size, max_len, batch_size
        self.val_fraction, self.limit_chars, self.seed, self.num_workers = val_fraction, limit_chars, seed, num_workers
        self.tokenizer_dir = tokenizer
        self.tokenizer: Any | None = None

    def documents(self) -> list[str]:
        return stdlib_documents(self.limit_chars) if self.source == "stdlib" else file_documents(self.files)

    def rows(self, documents: list[str]) -> torch.Tensor:
        """Token rows of ``max_len``: from a word tokenizer built on ``documents``, or the saved one."""
        if self.tokenizer_dir:
            self.tokenizer, first, last = saved_tokenizer(self.tokenizer_dir)
            ids = (self.tokenizer(d, add_special_tokens=False)["input_ids"] for d in documents)
            return pack(ids, self.max_len, first, last)
        self.tokenizer = WordTokenizer.build(documents, self.vocab_size)
        return pack((self.tokenizer.encode(d) for d in documents), self.max_len)

    def dataset(self, rows: torch.Tensor, seed: int) -> Any:
        """The map-style dataset of ``rows`` (``seed``: the training set's, or the validation set's)."""
        raise NotImplementedError(f"{type(self).__name__} must say what its rows become: define dataset(rows, seed)")

    def setup(self, stage: str | None = None) -> None:
        if self.train is not None:
            return
        rows = self.rows(self.documents())
        n_val = max(1, math.ceil(len(rows) * self.val_fraction)) if len(rows) > 1 else 0
        self.train = self.dataset(rows[n_val:] if n_val else rows, self.seed)
        self.val = self.dataset(rows[:n_val] if n_val else rows, self.seed + 1)
