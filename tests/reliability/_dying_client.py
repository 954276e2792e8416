"""A client process for test_client_death: opens a stream, reads some batches, then blocks.

``python -m tests.reliability._dying_client raw ENDPOINT JOB`` speaks the protocol with a raw
DEALER asking for shared memory (same boot id); ``... loader URL DATASET`` uses the real
``Loader``. Either prints one JSON line ``{"ready": ..., "shm": NAME|null}`` once it holds a
stream mid-epoch with credit outstanding, then waits to be killed (bounded: exits after 120 s).
"""

from __future__ import annotations

import json
import os
import sys
import time


def raw(endpoint: str, job: str) -> None:
    import zmq

    from shardserve.client.connection import read_boot_id
    from shardserve.proto.framing import decode, encode, peek_kind
    from shardserve.proto.messages import Credit, Hello, Kind, Welcome

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    hello = Hello(
        job=job,
        rank=0,
        epoch=0,
        credit=2,
        transport="auto",
        boot_id=read_boot_id(),
        pid=os.getpid(),
    )
    sock.send_multipart(encode(hello))
    welcome = None
    batches = 0
    deadline = time.monotonic() + 20
    while batches < 2:
        if time.monotonic() > deadline or not sock.poll(20_000):
            raise SystemExit("no Welcome/batches within 20 s")
        frames = sock.recv_multipart()
        kind = peek_kind(frames[0])
        if kind is Kind.BATCH:
            batches += 1
        else:
            msg = decode(frames)
            if isinstance(msg, Welcome):
                welcome = msg
    sock.send_multipart(encode(Credit(grant=2)))  # the server now owes batches to a soon-dead peer
    assert welcome is not None
    print(
        json.dumps(
            {
                "ready": True,
                "stream": welcome.stream,
                "transport": welcome.transport,
                "shm": welcome.shm.name if welcome.shm else None,
            }
        ),
        flush=True,
    )
    time.sleep(120)


def loader(url: str, dataset: str) -> None:
    from shardserve.client import Loader

    ld = Loader(url, dataset, batch_size=10, seed=5, prefetch=2, timeout=20.0, transport="tcp")
    it = iter(ld)
    for _ in range(3):
        next(it)
    print(json.dumps({"ready": True, "shm": None}), flush=True)
    time.sleep(120)


if __name__ == "__main__":
    mode, a, b = sys.argv[1:4]
    {"raw": raw, "loader": loader}[mode](a, b)
