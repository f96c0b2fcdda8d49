import pytest
import torch

from lightning_pipe.runtime.p2p import HEADER_LEN, TensorMeta


def test_header_round_trip() -> None:
    x = torch.randn(3, 4, 5, requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.bool)
    meta = TensorMeta.of([x, mask], was_tuple=True)
    header = meta.encode()
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    assert TensorMeta.decode(header) == meta
    assert meta.requires_grad == (True, False) and meta.dtypes == (torch.float32, torch.bool)


def test_header_too_large_is_explained() -> None:
    many = [torch.zeros(1, 1, 1, 1) for _ in range(40)]
    with pytest.raises(ValueError, match="return fewer tensors between stages"):
        TensorMeta.of(many, True).encode()
