"""A Connection replaced in place (``reopen``) is a new peer on the same endpoint."""

from __future__ import annotations

import zmq

from shardserve.client.connection import Connection
from shardserve.proto.framing import decode
from shardserve.proto.messages import Heartbeat
from tests.support.slowness import scaled


def test_reopen_is_a_new_peer_that_still_talks() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    conn = Connection(f"tcp://127.0.0.1:{port}", heartbeat_s=1.0)
    try:
        seen = []
        for _ in range(2):
            assert conn.send(Heartbeat())
            assert router.poll(int(scaled(10.0) * 1000)), (
                "no message from the Connection within 10 s"
            )
            ident, frame = router.recv_multipart()
            assert isinstance(decode([frame]), Heartbeat)
            seen.append(ident)
            conn.last_stream = 7
            conn.reopen()
            assert conn.last_stream is None and not conn.closed
        assert seen[0] != seen[1], "reopen kept the old socket"
    finally:
        conn.close()
        router.close()
        ctx.term()
