"""The stages compare the parameters outside the split layers once at setup."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from lightning_pipe.runtime.grads import outside_agreement
from lightning_pipe.runtime.grads.outside_agreement import check_outside_agreement, disagreement, signature


def test_a_signature_names_each_tensor_once_by_the_first_name_named_parameters_gives() -> None:
    head = nn.Linear(4, 3)
    model = nn.Module()
    model.head = head
    model.bias = head.bias  # the same tensor under a second name
    assert signature(model, [head.bias, head.weight]) == [("bias", (3,), "float32"), ("head.weight", (3, 4), "float32")]


def test_equal_lists_agree_and_an_extra_parameter_is_named() -> None:
    a = [("norm.weight", (8,), "float32")]
    b = a + [("cls.predictions.bias", (96,), "float32")]
    assert disagreement([a, a, a]) is None
    message = disagreement([b, a])
    assert message is not None
    assert "stage 0 has cls.predictions.bias [96] float32 that stage 1 does not" in message
    assert "module=" in message


def test_another_order_and_another_shape_are_told() -> None:
    a = [("x", (2,), "float32"), ("y", (3,), "float32")]
    assert "another order" in str(disagreement([a, a[::-1]]))
    assert "stage 1 has x [4] float32" in str(disagreement([a, [("x", (4,), "float32"), a[1]]]))


def test_the_check_raises_on_every_stage_from_what_the_group_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(2, 2)

    def gathered(out: list, mine: Any, group: Any) -> None:
        out[0], out[1] = mine, mine[:1]

    monkeypatch.setattr(outside_agreement.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(outside_agreement.dist, "all_gather_object", gathered)
    with pytest.raises(RuntimeError, match="stage 0 has bias"):
        check_outside_agreement(model, [model.weight, model.bias], None, 2)
    check_outside_agreement(model, [model.weight, model.bias], None, 1)  # one stage: nothing to compare
