"""Ports for the tests' process groups, from a range of this pytest-xdist worker's own below the kernel's
ephemeral ports: a port found free and handed to a store cannot be taken meanwhile by another worker's
outgoing connection (which the kernel gives an ephemeral port) or by another worker's next store."""

from __future__ import annotations

import itertools
import os
import socket

#: each worker's ports: [BASE + SPAN * k, BASE + SPAN * (k + 1)), below Linux's ephemeral range (32768 up)
BASE, SPAN = 12000, 5000
_next = itertools.count()


def free_port() -> int:
    """The next port of this worker's range that nothing listens on."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    first = BASE + SPAN * (index % 4)
    for _ in range(SPAN):
        port = first + next(_next) % SPAN
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {first}..{first + SPAN - 1}")
