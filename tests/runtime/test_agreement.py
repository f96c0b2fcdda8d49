"""The per-step comparison of batch shapes between stages, without processes."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from lightning_pipe.runtime import agreement
from lightning_pipe.runtime.agreement import checksum, describe, fingerprint, mismatch_message
from lightning_pipe.runtime.microbatch import signature, split


def _keys(*shape: int) -> list[tuple]:
    batch = (torch.zeros(*shape), torch.zeros(shape[0], dtype=torch.int64))
    return [signature(mb) for mb in split(batch, 3)]


def test_equal_batches_agree_and_different_ones_do_not() -> None:
    a, b = fingerprint(_keys(12, 5, 6)), fingerprint(_keys(12, 5, 6))
    assert torch.equal(a, b)
    assert mismatch_message([a.tolist(), b.tolist()]) is None
    for other in (_keys(12, 7, 6), _keys(11, 5, 6), [(((4, 5, 6), torch.float64),)] * 3):
        assert not torch.equal(a, fingerprint(other))


def test_the_message_names_each_stages_shapes() -> None:
    rows = [fingerprint(_keys(12, 5, 6)).tolist(), fingerprint(_keys(12, 6, 6)).tolist()]
    message = mismatch_message(rows)
    assert message is not None
    assert "stage 0: 3 micro-batches, the first with tensor shapes [(4, 5, 6), (4,)]" in message
    assert "stage 1: 3 micro-batches, the first with tensor shapes [(4, 6, 6), (4,)]" in message
    assert "seeded from the index" in message
    assert describe(rows[0]).startswith("3 micro-batches")


def test_the_fingerprint_is_the_same_in_another_process() -> None:
    """Python salts ``hash`` of strings per process; the fingerprint must not depend on it."""
    code = (
        "import torch; from tests.runtime.test_agreement import _keys; "
        "from lightning_pipe.runtime.agreement import fingerprint; print(fingerprint(_keys(12, 5, 6)).tolist())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == str(fingerprint(_keys(12, 5, 6)).tolist())


def test_equal_shapes_with_other_values_are_told_apart_and_explained() -> None:
    x = torch.arange(24.0).reshape(4, 6)
    keys = [signature(x)]
    same = fingerprint(keys, [x.clone()]).tolist()
    assert same == fingerprint(keys, [x]).tolist()
    other = fingerprint(keys, [x + 1]).tolist()
    message = mismatch_message([same, other], "the training DataLoader (dataset Noisy)")
    assert (
        message is not None
        and "different data for the same step from the training DataLoader (dataset Noisy)" in message
    )
    assert "same shapes (1 micro-batches, the first with tensor shapes [(4, 6)])" in message
    assert fingerprint(keys).tolist()[2] == -1  # no values compared


def test_the_checksum_samples_the_whole_of_every_tensor() -> None:
    x, y = torch.arange(4096.0).reshape(256, 16), torch.arange(256) % 10
    base = checksum([x, y])
    assert base == checksum([x.clone(), y.clone()])
    late = x.clone()
    late[-1, -1] += 1  # the sample reaches the last element
    assert checksum([late, y]) != base
    other_labels = y.clone()
    other_labels[128] += 1
    assert checksum([x, other_labels]) != base
    assert checksum([x.to(torch.bfloat16), y]) == checksum([x.to(torch.bfloat16), y])
    assert checksum([torch.zeros(0), torch.ones(3, dtype=torch.bool)]) == checksum([torch.ones(3, dtype=torch.bool)])


def test_the_source_is_named_only_when_the_stages_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-step post gives the DataLoader's name as a function: formatting it every step would
    cost more than the check."""
    x = torch.arange(24.0).reshape(4, 6)
    theirs: list[torch.Tensor] = []

    def all_gather(rows: list[torch.Tensor], mine: torch.Tensor, group: object, async_op: bool) -> SimpleNamespace:
        rows[0].copy_(mine)
        rows[1].copy_(theirs[0])
        return SimpleNamespace(wait=lambda: None)

    monkeypatch.setattr(agreement.dist, "all_gather", all_gather)
    named: list[int] = []

    def source() -> str:
        named.append(1)
        return "the training DataLoader (dataset Noisy) at batch 3 of epoch 1 (global step 7)"

    board = agreement.BatchAgreement(group=None, num_stages=2)
    theirs.append(fingerprint([signature(x)], [x]))
    board.post([signature(x)], [x], source)
    board.check()
    assert named == []
    theirs[0] = fingerprint([signature(x)], [x + 1])
    board.post([signature(x)], [x], source)
    with pytest.raises(
        RuntimeError,
        match=r"from the training DataLoader \(dataset Noisy\) at batch 3 of epoch 1 \(global step 7\): the batches "
        r"have the same shapes",
    ):
        board.check()
    assert named == [1]
