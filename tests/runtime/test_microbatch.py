from collections import namedtuple

import pytest
import torch

from lightning_pipe.runtime.microbatch import as_tuple, batch_size, signature, split, split_sizes


def test_split_sizes_even_uneven_and_short() -> None:
    assert split_sizes(8, 4) == [2, 2, 2, 2]
    assert split_sizes(8, 3) == [3, 3, 2]
    assert split_sizes(2, 4) == [1, 1]  # a short batch: as many micro-batches as it allows
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        split_sizes(4, 0)


def test_split_nested_batches_and_keeps_non_tensors() -> None:
    Pair = namedtuple("Pair", "x y")
    batch = {"pair": Pair(torch.arange(10).view(5, 2), torch.arange(5)), "names": "abc", "scale": torch.tensor(2.0)}
    parts = split(batch, 2)
    assert [p["pair"].y.tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    assert isinstance(parts[0]["pair"], Pair)
    assert parts[1]["names"] == "abc" and parts[1]["scale"].item() == 2.0
    assert torch.equal(torch.cat([p["pair"].x for p in parts]), batch["pair"].x)


def test_batch_size_errors() -> None:
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        batch_size(["a", "b"])
    with pytest.raises(ValueError, match="disagree on the batch dimension"):
        batch_size((torch.zeros(3), torch.zeros(4)))


def test_signature_tracks_shapes_and_dtypes() -> None:
    a = (torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
    assert signature(a) == signature((torch.ones(4, 3), torch.ones(4, dtype=torch.long)))
    assert signature(a) != signature((torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)))


def test_as_tuple_explains_bad_outputs() -> None:
    assert as_tuple(torch.zeros(1))[1] is False
    assert as_tuple((torch.zeros(1), torch.zeros(1)))[1] is True
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        as_tuple({"x": torch.zeros(1)})
