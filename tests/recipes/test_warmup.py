import itertools
import math

import pytest
import torch

from lightning_pipe.recipes.warmup import warmup_then_decay


def _rates(decay: str, floor: float = 0.0, steps: int = 12) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    schedule = warmup_then_decay(optimizer, warmup_steps=3, max_steps=10, decay=decay, floor=floor)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


def test_warmup_then_linear_or_cosine_decay() -> None:
    linear = _rates("linear")
    assert linear[:4] == pytest.approx([2 / 3, 4 / 3, 2.0, 2.0])  # warm-up, then the full rate at step 3
    assert linear[3:] == pytest.approx([2.0 * (10 - s) / 7 for s in range(3, 10)] + [0.0, 0.0])
    cosine = _rates("cosine", floor=0.1)
    assert cosine[:4] == pytest.approx([2 / 3, 4 / 3, 2.0, 2.0])
    assert cosine[6] == pytest.approx(2.0 * (0.1 + 0.9 * 0.5 * (1 - math.cos(math.pi * 4 / 7))))
    assert cosine[10:] == pytest.approx([0.2, 0.2])  # the floor from max_steps on
    assert all(a > b for a, b in itertools.pairwise(cosine[3:11]))
    with pytest.raises(ValueError, match="valid decays are linear, cosine"):
        _rates("step")
