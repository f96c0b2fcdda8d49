"""One collective for many tensors, and accumulating into ``.grad`` as autograd does."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipe.runtime.grads.flat import FlatAllReduce, add_grad
from lightning_pipe.runtime.topology import Topology


def test_add_grad_takes_the_first_gradient_and_adds_later_ones() -> None:
    param = nn.Parameter(torch.zeros(3))
    first = torch.ones(3)
    add_grad(param, first)
    assert param.grad is first  # no copy, as AccumulateGrad
    add_grad(param, torch.full((3,), 2.0))
    assert torch.equal(param.grad, torch.full((3,), 3.0))


def test_a_flat_reduce_leaves_the_result_in_each_tensor(world_of_one: Topology) -> None:
    tensors = [torch.arange(6.0).reshape(2, 3), torch.tensor(5.0), torch.arange(4.0)]
    originals = [t.clone() for t in tensors]
    reduce = FlatAllReduce(tensors, world_of_one.dp_group)
    assert reduce.flat.numel() == 11
    reduce.flat.mul_(4)  # as if the sum over four ranks had arrived
    returned = reduce.wait(divisor=2)
    assert returned is reduce.tensors
    for t, o in zip(tensors, originals):
        assert torch.equal(t, 2 * o)  # the same tensors (shapes kept), now holding the result


def test_a_blocking_flat_reduce_has_no_work_to_wait_for(world_of_one: Topology) -> None:
    tensors = [torch.ones(2), torch.ones(3)]
    reduce = FlatAllReduce(tensors, world_of_one.pp_group, async_op=False)
    assert reduce.work is None
    assert [t.tolist() for t in reduce.wait()] == [[1.0, 1.0], [1.0, 1.0, 1.0]]
