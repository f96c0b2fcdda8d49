import torch

from lightning_pipe.runtime.p2p import TensorMeta


def test_header_round_trip() -> None:
    x = torch.randn(3, 4, 5, requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.bool)
    meta = TensorMeta.of([x, mask], was_tuple=True)
    header = meta.encode()
    assert header.dtype == torch.int64
    assert TensorMeta.decode(header) == meta
    assert meta.requires_grad == (True, False) and meta.dtypes == (torch.float32, torch.bool)


def test_a_header_has_no_fixed_size() -> None:
    """The hidden state and the router logits of 64 blocks (what a 64-layer MoE's last boundary
    carries): the header grows with them (its length goes first) instead of being capped."""
    hidden = torch.randn(2, 16, 64, requires_grad=True)
    logits = [torch.randn(32, 8, requires_grad=True) for _ in range(64)]
    meta = TensorMeta.of([hidden, *logits], False, carried=(1,) * 64)
    header = meta.encode()
    assert header.numel() == 3 + 64 + (3 + 3) + 64 * (3 + 2)
    assert TensorMeta.decode(header) == meta and TensorMeta.decode(header).carried == (1,) * 64


def test_host_staging_sends_and_receives_copies_in_host_memory() -> None:
    from lightning_pipe.runtime.p2p import Transport

    transport = Transport([0, 1], torch.device("cpu"), through_host=True)
    x = torch.randn(3, 4, requires_grad=True)
    (op,) = transport.gradient_send_ops(0, [x])
    assert (
        op.tensor.device.type == "cpu" and op.tensor.data_ptr() != x.data_ptr() and torch.equal(op.tensor, x.detach())
    )
    buffers, ops = transport.gradient_recv_ops(1, [x])
    assert buffers[0].device.type == "cpu" and ops[0].tensor is buffers[0]
    (arrived,) = transport.arrived(buffers)
    assert arrived.data_ptr() != buffers[0].data_ptr()  # copied to the rank's device (here: a host copy)
    direct = Transport([0, 1], torch.device("cpu"))
    assert direct.arrived(buffers) is buffers
