"""Checksums of a checkpoint's tensors: what they cover, and the verifier that compares the tensors
of the names a rank uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_pipe.checkpoint import checksums


def test_a_checksum_covers_bytes_dtype_and_shape() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    same = checksums.tensor_checksum(base.clone())
    assert checksums.tensor_checksum(base) == same
    assert checksums.tensor_checksum(base.T.contiguous().T) == same  # the values, not the memory layout
    changed = base.clone()
    changed[1, 2] = 6.000001
    for other in (changed, base.reshape(4, 3), base.view(torch.int32)):
        assert checksums.tensor_checksum(other) != same
    for odd in (torch.ones(2, dtype=torch.bfloat16), torch.tensor(True), torch.tensor(3.0), torch.empty(0, 5)):
        assert checksums.tensor_checksum(odd) == checksums.tensor_checksum(odd.clone())


def test_the_verifier_checks_the_tensors_of_the_names_asked_for(tmp_path: Path) -> None:
    shard = {
        "state_dict": {"a.weight": torch.ones(3), "b.weight": torch.zeros(3)},
        "optimizer_states": [
            {"state": {"a.weight": {"exp_avg": torch.ones(3)}, "b.weight": {"exp_avg": torch.ones(3)}}}
        ],
        "extra": {"scale": torch.tensor(2.0)},
    }
    recorded = checksums.record(shard)
    assert set(recorded) == {
        ("state_dict", "a.weight"), ("state_dict", "b.weight"), ("extra", "scale"),
        ("optimizer_states", 0, "state", "a.weight", "exp_avg"),
        ("optimizer_states", 0, "state", "b.weight", "exp_avg"),
    }  # fmt: skip
    shard["optimizer_states"][0]["state"]["b.weight"]["exp_avg"][1] = 5.0  # damage b's optimizer state
    verifier = checksums.Verifier(tmp_path / "f.pt", shard, recorded, shard["state_dict"])
    verifier.verify(["a.weight"])  # a's tensors and the unnamed ones are whole
    with pytest.raises(
        RuntimeError, match=r"f.pt is damaged: the tensor optimizer_states/0/state/b.weight/exp_avg does not match"
    ):
        verifier.verify(["b.weight"])
    with pytest.raises(RuntimeError, match=r"optimizer_states/0/state/b.weight/exp_avg"):
        checksums.Verifier(tmp_path / "f.pt", shard, recorded, shard["state_dict"]).verify()
    shard["extra"]["scale"] += 1  # a tensor of no name is every reader's
    with pytest.raises(RuntimeError, match=r"the tensor extra/scale does not match"):
        checksums.Verifier(tmp_path / "f.pt", shard, recorded, shard["state_dict"]).verify([])
    del shard["extra"]
    with pytest.raises(RuntimeError, match=r"the tensor extra/scale, recorded when it was written, is missing"):
        checksums.Verifier(tmp_path / "f.pt", shard, recorded, shard["state_dict"]).verify([])
