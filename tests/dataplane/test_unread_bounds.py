"""Memory held for streams that have not read is bounded per stream and server-wide, by what
the server counts (``shardserve_unread_bytes``), not by RSS: raw peers say Hello with a large
credit and never read; a stream past the server-wide bound waits, Welcomed and sent nothing,
until a stream that has not read reads."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shardserve.proto.messages import Welcome
from tests.server.rawclient import Batch, RawStream, zmq_context
from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, make_job, run_server
from tests.support.slowness import scaled

BATCH = 64
#: Bytes of one batch of the cifar-like set: a uint8 3x32x32 image and an int64 label each
#: (the server's estimate adds a little: the bounds below leave half a batch of slack).
BATCH_BYTES = BATCH * (3 * 32 * 32 + 8)
CREDIT = 16


def gauge(srv: ServerProc, name: str) -> float:
    text = httpx.get(f"{srv.http_url}/metrics", headers=srv.headers, timeout=scaled(10)).text
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert m is not None, f"no {name} in /metrics"
    return float(m.group(1))


def batch_of(peer: RawStream, what: str) -> Batch:
    while True:
        msg = peer.recv(scaled(20), what=what)
        if isinstance(msg, Batch):
            return msg


@pytest.fixture()
def srv(tmp_path: Path) -> Iterator[ServerProc]:
    make_cifar_like(tmp_path, n=4096)
    # Two batches a stream before it reads; five for all of them together.
    flags = ("--unread-stream-bytes", str(int(2.5 * BATCH_BYTES)))
    flags += ("--unread-bytes", str(int(5.5 * BATCH_BYTES)))
    with run_server(tmp_path, *flags) as s:
        yield s


def test_streams_that_never_read_hold_their_allotment_and_no_more(srv: ServerProc) -> None:
    """Four peers grant 16 batches each and never read: the first two are allotted two
    batches each (the per-stream bound), the third the one left under the server-wide bound,
    the fourth waits with nothing; once the first reads, its whole credit flows and the
    fourth gets its batches."""
    jobs = [make_job(srv, batch_size=BATCH, seed=i) for i in range(4)]
    with zmq_context() as ctx:
        peers = [RawStream(ctx, srv.tcp_endpoint) for _ in jobs]
        for peer, job in zip(peers, jobs, strict=True):
            peer.hello(job, credit=CREDIT)
            peer.recv_kind(Welcome, timeout=scaled(20))  # allotted before its Welcome
        held = gauge(srv, "shardserve_unread_bytes")
        assert 5 * BATCH_BYTES <= held <= 5.5 * BATCH_BYTES  # five batches: 2 + 2 + 1 + 0
        assert gauge(srv, "shardserve_unread_waiting_streams") == 1
        first = [batch_of(peers[0], f"batch {i} of the first peer") for i in range(2)]
        assert [b.header.index for b in first] == [0, 1]
        peers[0].grant(2)  # it read: its allotment goes back, and its credit is its bound
        got = batch_of(peers[3], "the waiting peer's first batch")
        assert got.header.index == 0
        assert batch_of(peers[0], "the first peer's third batch").header.index == 2
        deadline = time.monotonic() + scaled(20)
        while gauge(srv, "shardserve_unread_waiting_streams") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gauge(srv, "shardserve_unread_waiting_streams") == 0
        assert gauge(srv, "shardserve_unread_bytes") <= held
        for peer in peers:
            peer.close()
