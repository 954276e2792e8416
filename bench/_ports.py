"""TCP ports a test or a benchmark names before its server binds them (a restart on the same
port, a data port whose streaming processes bind the next ones).

::

    http, data = free_port(), free_port()
    with run_server(store, http_port=http, data_port=data) as srv:
        ...
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

# A port named up front is picked below the kernel's ephemeral range: there no bind(0) or
# outgoing connection anywhere on the machine can take it between the pick and the server's
# own bind, as one did to a restarted server's port. Each pytest-xdist worker picks from its
# own slice, a block of PORT_BLOCK ports at a time (streaming process k binds the data port
# + k).
PORT_BLOCK = 4
_FIRST_PORT = 10_000
_SLICE = 1_000
_picks = itertools.count(os.getpid())


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port P on 127.0.0.1 with P .. P + PORT_BLOCK - 1 unbound, outside the range the
    kernel hands out by itself, and not one another pytest worker picks."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    low = _FIRST_PORT + (int(worker) if worker.isdigit() else 0) * _SLICE
    if low + _SLICE > _ephemeral_low():  # an unusual range: let the kernel pick
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    blocks = _SLICE // PORT_BLOCK
    for _ in range(blocks):
        port = low + next(_picks) % blocks * PORT_BLOCK
        if all(_bindable(port + k) for k in range(PORT_BLOCK)):
            return port
    raise RuntimeError(f"no {PORT_BLOCK} free ports together in 127.0.0.1:{low}-{low + _SLICE}")
