import torch

from lightning_pipe.runtime.crossing.seam import Packing
from lightning_pipe.runtime.crossing.wire import TensorMeta


def test_header_round_trip() -> None:
    x = torch.randn(3, 4, 5, requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.bool)
    meta = TensorMeta.of([x, mask], Packing(was_tuple=True))
    header = meta.encode()
    assert header.dtype == torch.int64
    assert TensorMeta.decode(header) == meta
    assert meta.requires_grad == (True, False) and meta.dtypes == (torch.float32, torch.bool)


def test_a_header_has_no_fixed_size() -> None:
    """The hidden state and the router logits of 64 blocks (what a 64-layer MoE's last boundary
    carries): the header grows with them (its length goes first) instead of being capped."""
    hidden = torch.randn(2, 16, 64, requires_grad=True)
    logits = [torch.randn(32, 8, requires_grad=True) for _ in range(64)]
    meta = TensorMeta.of([hidden, *logits], Packing(recorded=(1,) * 64))
    header = meta.encode()
    assert header.numel() == 3 + 64 + (3 + 3) + 64 * (3 + 2)
    assert TensorMeta.decode(header) == meta and TensorMeta.decode(header).packing.recorded == (1,) * 64


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


def test_each_micro_batch_has_its_own_tag_on_each_stream() -> None:
    """A message meets the receive of the micro-batch it carries: the two ends name the same tag, and
    no two (stream, micro-batch) share one (in gloo's 32-bit range)."""
    from lightning_pipe.runtime.p2p import Transport

    transport = Transport([0, 1, 0, 1], torch.device("cpu"))
    x = torch.randn(2, 3)
    for microbatch in range(4):
        (sent,) = transport.gradient_send_ops(1, [x], microbatch)
        (received,) = transport.gradient_recv_ops(2, [x], microbatch)[1]
        assert sent.tag == received.tag
    assert transport.gradient_send_ops(1, [x], 2)[0].tag != transport.gradient_send_ops(1, [x], 3)[0].tag
    streams = 2 * 4 + 4 * 4 * 4
    tags = {transport.tag(stream, i) for stream in range(streams) for i in range(64)}
    assert len(tags) == streams * 64 and max(tags) < 2**31
    assert 0 <= transport.tag(streams - 1, 10**12) < 2**31  # the asynchronous schedules' global numbers wrap


def test_a_new_shapes_header_is_named_by_the_first_micro_batch_with_those_shapes() -> None:
    from lightning_pipe.runtime.executor import first_alike

    assert first_alike([(3,), (1,), (3,), (1,)]) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert first_alike({9: (1,), 8: (2,), 10: (1,)}) == {8: 8, 9: 9, 10: 9}
