"""Gradient-accumulation fusion gives autograd's gradients, and steps aside where it cannot."""

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from lightning_pipe.runtime.grads import fused_linear
from lightning_pipe.runtime.grads.fused_linear import _Forward, accumulating, install, uninstall


def _net(bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 5, bias=bias), nn.ReLU(), nn.Sequential(nn.Linear(5, 5, bias=bias), nn.Tanh()), nn.Linear(5, 3)
    )


def _accumulate_microbatches(
    net: nn.Module, xs: list[torch.Tensor], use_checkpoint: bool = False
) -> list[torch.Tensor]:
    grads_in = []
    for x in xs:
        x = x.clone().requires_grad_(True)
        out = checkpoint(net, x, use_reentrant=False) if use_checkpoint else net(x)
        (out.square().sum() * 0.5).backward()
        grads_in.append(x.grad)
    return grads_in


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 6)])  # a batch of rows; a batch of sequences
@pytest.mark.parametrize("use_checkpoint", [False, True])
def test_fused_gradients_equal_autograd(bias: bool, shape: tuple[int, ...], use_checkpoint: bool) -> None:
    xs = [torch.randn(*shape) for _ in range(3)]
    reference, fused = _net(bias), _net(bias)
    expected_inputs = _accumulate_microbatches(reference, xs, use_checkpoint)
    layers = install(fused)
    assert len(layers) == 3
    calls = []
    original = fused_linear._LinearAccumulate.backward

    def counting(ctx, grad):
        calls.append(1)
        return original(ctx, grad)

    fused_linear._LinearAccumulate.backward = staticmethod(counting)  # type: ignore[method-assign]
    try:
        with accumulating():
            got_inputs = _accumulate_microbatches(fused, xs, use_checkpoint)
    finally:
        fused_linear._LinearAccumulate.backward = original  # type: ignore[method-assign]
    assert len(calls) == 3 * len(xs)  # the fused backward ran for every layer and micro-batch
    for a, b in zip(got_inputs, expected_inputs):
        torch.testing.assert_close(a, b)
    for (name, p), q in zip(fused.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_first_stage_input_needs_no_gradient() -> None:
    net = _net()
    install(net)
    with accumulating():
        net(torch.randn(4, 6)).sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_plain_path_outside_the_block_and_in_the_cases_it_cannot_fuse() -> None:
    net = _net()
    install(net)
    x = torch.randn(4, 6)

    def fused_nodes(out: torch.Tensor) -> int:
        seen, stack, count = set(), [out.grad_fn], 0
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            count += "_LinearAccumulate" in type(node).__name__
            stack.extend(next_fn for next_fn, _ in node.next_functions)
        return count

    assert fused_nodes(net(x)) == 0  # not accumulating: autograd.grad and hooks behave as usual
    with accumulating():
        assert fused_nodes(net(x)) == 3
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert fused_nodes(net(x)) == 0
        versions = {n: p.detach().clone().requires_grad_(True) for n, p in net.named_parameters()}
        assert fused_nodes(functional_call(net, versions, (x,))) == 3  # stashed weight versions are leaves
        computed = {n: p * 1.0 for n, p in net.named_parameters()}
        assert fused_nodes(functional_call(net, computed, (x,))) == 0  # a computed weight is not
        handle = net[0].weight.register_hook(lambda g: g)
        assert fused_nodes(net(x)) == 2  # a hooked weight takes autograd's path
        handle.remove()
        net[3].weight.requires_grad_(False)
        net[3].bias.requires_grad_(False)
        assert fused_nodes(net(x)) == 2
        with torch.no_grad():
            assert net(x).grad_fn is None
        with pytest.raises(RuntimeError):  # a dtype mismatch fails in F.linear, as without fusion
            net(x.double())
    # the same values whichever path ran
    net[3].weight.requires_grad_(True)
    with accumulating():
        fused_out = net(x)
    torch.testing.assert_close(fused_out, net(x))


def test_weight_versions_receive_their_gradients() -> None:
    reference, net = _net(), _net()
    install(net)
    x = torch.randn(4, 6)
    versions = {n: p.detach().requires_grad_(True) for n, p in net.named_parameters()}
    with accumulating():
        for _ in range(2):  # two micro-batches on one version: the second accumulates
            functional_call(net, versions, (x,)).square().sum().backward()
    for _ in range(2):
        reference(x).square().sum().backward()
    for (name, version), param in zip(versions.items(), reference.parameters()):
        torch.testing.assert_close(version.grad, param.grad, msg=name)
    assert all(p.grad is None for p in net.parameters())  # the version's gradient, not the parameter's


def test_frozen_bias_gets_no_gradient() -> None:
    net = _net()
    install(net)
    for layer in (net[0], net[2][0], net[3]):
        layer.bias.requires_grad_(False)
    with accumulating():
        net(torch.randn(4, 6)).sum().backward()
    assert all(layer.bias.grad is None and layer.weight.grad is not None for layer in (net[0], net[2][0], net[3]))


def test_install_is_idempotent_and_undone_and_survives_copy() -> None:
    net = _net()
    first = install(net)
    assert install(net) == first
    assert type(net[0]) is nn.Linear and isinstance(net[0].__dict__["forward"], _Forward)
    clone = copy.deepcopy(net)
    assert clone[0].__dict__["forward"].layer is clone[0]
    restored = pickle.loads(pickle.dumps(net))
    assert restored[0].__dict__["forward"].layer is restored[0]
    uninstall(first)
    assert all("forward" not in layer.__dict__ for layer in first)
    assert set(net.state_dict()) == set(_net().state_dict())


def test_subclasses_and_foreign_forwards_are_left_alone() -> None:
    class Special(nn.Linear):
        pass

    other = nn.Linear(3, 3)
    own = other.forward
    other.forward = lambda x: own(x) * 2  # type: ignore[method-assign]
    net = nn.Sequential(Special(3, 3), other, nn.Linear(3, 3))
    assert install(net) == [net[2]]
