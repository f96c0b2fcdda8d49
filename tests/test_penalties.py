"""lightning_pipe.parameter_penalty without the pipeline: the gradient of the term added before each update."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipe import parameter_penalty


def test_an_update_with_the_penalty_equals_one_with_the_term_in_the_loss() -> None:
    torch.manual_seed(0)
    model, x = nn.Linear(4, 2), torch.randn(5, 4)
    twin = nn.Linear(4, 2)
    twin.load_state_dict(model.state_dict())
    frozen = nn.Parameter(torch.ones(2))  # no gradient: left as it is
    penalized = parameter_penalty(torch.optim.SGD([*model.parameters(), frozen], lr=0.5), lambda p: 0.3 * p.abs().sum())
    in_loss = torch.optim.SGD(twin.parameters(), lr=0.5)

    def closure() -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    returned = penalized.step(closure)
    (twin(x).pow(2).mean() + sum(0.3 * p.abs().sum() for p in twin.parameters())).backward()
    in_loss.step()
    assert returned is not None
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)
    assert torch.equal(frozen, torch.ones(2))


def test_an_lr_scheduler_built_on_a_penalized_optimizer_steps_it() -> None:
    """torch's schedulers wrap the optimizer's bound ``step``: the penalty's step is one (it failed with
    "'function' object has no attribute '__func__'"), and the penalty still reaches the update."""
    weight = nn.Parameter(torch.ones(3))
    optimizer = parameter_penalty(torch.optim.SGD([weight], lr=1.0), lambda p: 0.5 * (p**2).sum())
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    weight.grad = torch.zeros(3)
    optimizer.step()
    schedule.step()
    torch.testing.assert_close(weight.detach(), torch.zeros(3))  # 1 - 1.0 * (0 + 1.0)
    assert schedule.get_last_lr() == [0.5]
