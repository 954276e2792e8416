"""Hostile or malformed data-plane input, against a live server with raw DEALERs.

Already covered in tests/server/test_data_plane.py and not repeated: bad magic, an unknown kind
with a good prefix, bad JSON, credit without a stream, a server-only message kind, absurd credit,
unknown job, rank >= world size, start past the end, wrong protocol version in Hello.
Here: truncated frames, extra frames, wrong versions on other kinds, batch headers claiming huge
sizes, an over-limit frame, a 1,000-message flood, random frames (hypothesis), and RSS.
"""

from __future__ import annotations

import json
import struct
import time
from itertools import count

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardserve.proto.errors import ErrorCode
from shardserve.proto.framing import MAGIC, encode
from shardserve.proto.messages import (
    PROTOCOL_VERSION,
    Credit,
    EndOfEpoch,
    Error,
    Heartbeat,
    Hello,
    Kind,
    Reject,
    Welcome,
)
from tests.reliability.conftest import healthy, make_job, rss_bytes
from tests.server.rawclient import RawStream, zmq_context
from tests.support.data import sample_id_of
from tests.support.server import ServerProc
from tests.support.slowness import scaled

#: What every message's header frame starts with: the magic and this protocol's version.
HEAD = b"SS" + bytes([PROTOCOL_VERSION])

#: Growth of the server's RSS over the whole hostile module that still counts as "bounded".
RSS_SLACK = 100 << 20
FUZZ_CASES: dict[str, int] = {}
_barrier = count()


def _barrier_name() -> str:
    return f"barrier-{next(_barrier)}"


def replies_until_barrier(s: RawStream, timeout: float | None = None) -> list[object]:
    """Send a Hello for a unique unknown job and collect every reply before its JOB_NOT_FOUND.

    The server handles one peer's messages in order and answers on one socket, so whatever it
    said about earlier messages arrives before the barrier's answer.
    """
    timeout = scaled(10.0) if timeout is None else timeout
    name = _barrier_name()
    s.send(Hello(job=name, rank=0, epoch=0, credit=1, transport="socket"))
    got: list[object] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no answer to barrier {name} within {timeout} s; got {got[-5:]}"
        msg = s.recv(timeout=left, what=f"the answer to barrier Hello {name}")
        if (
            isinstance(msg, Error)
            and msg.code == ErrorCode.JOB_NOT_FOUND
            and repr(name) in msg.message
        ):
            return got
        got.append(msg)


def assert_serves_an_epoch(srv: ServerProc, ctx: zmq.Context) -> None:
    job = make_job(srv, dataset="other", batch_size=50, seed=7)
    g = RawStream(ctx, srv.tcp_endpoint)
    g.hello(job, credit=2)
    g.recv_kind(Welcome)
    batches, _ = g.read_epoch()
    ids = np.concatenate([sample_id_of(b.parts) for b in batches])
    assert np.array_equal(np.sort(ids), np.arange(200))
    g.close()


@pytest.fixture(scope="module")
def baseline_rss(rel_server: ServerProc) -> int:
    """The server's RSS before any hostile input (after one warm-up epoch)."""
    with zmq_context() as ctx:
        assert_serves_an_epoch(rel_server, ctx)
    return rss_bytes(rel_server.proc.pid)


def _hello_frame(**kw: object) -> bytes:
    base = {"job": "x", "rank": 0, "epoch": 0, "credit": 1, **kw}
    return encode(Hello(**base))[0]  # type: ignore[arg-type]


def _batch_header(nparts: int, shape: tuple[int, ...], nbytes: int) -> bytes:
    out = bytearray(MAGIC + bytes([PROTOCOL_VERSION, int(Kind.BATCH)]))
    out += struct.pack("<IIIiHIH", 1, 0, 0, -1, 1, 0, nparts)
    for _ in range(nparts):
        out += struct.pack("<B", 1) + b"x" + struct.pack("<BB", 3, len(shape))
        out += struct.pack(f"<{len(shape)}q", *shape) + struct.pack("<QQ", nbytes, 0)
    return bytes(out)


HOSTILE: list[tuple[str, list[bytes], set[ErrorCode]]] = [
    ("empty frame", [b""], {ErrorCode.MALFORMED}),
    ("prefix only, 3 bytes", [HEAD], {ErrorCode.MALFORMED}),
    ("Hello truncated mid-JSON", [_hello_frame()[:20]], {ErrorCode.MALFORMED}),
    ("Hello with a trailing extra frame", [_hello_frame(), b"extra"], {ErrorCode.MALFORMED}),
    (
        "Hello JSON with unknown field",
        [
            HEAD
            + b"\x01"
            + json.dumps({"job": "x", "rank": 0, "epoch": 0, "credit": 1, "evil": 1}).encode()
        ],
        {ErrorCode.MALFORMED},
    ),
    (
        "Hello with negative rank",
        [HEAD + b"\x01" + json.dumps({"job": "x", "rank": -1, "epoch": 0, "credit": 1}).encode()],
        {ErrorCode.MALFORMED},
    ),
    (
        "Hello with rank 10**40",
        [
            HEAD
            + b"\x01"
            + json.dumps({"job": "x", "rank": 10**40, "epoch": 0, "credit": 1}).encode()
        ],
        {ErrorCode.MALFORMED, ErrorCode.JOB_NOT_FOUND},
    ),
    (
        "Hello with credit 0",
        [HEAD + b"\x01" + json.dumps({"job": "x", "rank": 0, "epoch": 0, "credit": 0}).encode()],
        {ErrorCode.MALFORMED},
    ),
    (
        "Hello with credit 10**9",
        [
            HEAD
            + b"\x01"
            + json.dumps({"job": "x", "rank": 0, "epoch": 0, "credit": 10**9}).encode()
        ],
        {ErrorCode.MALFORMED},
    ),
    (
        "Hello with a 100 KiB job name",
        [
            HEAD
            + b"\x01"
            + json.dumps({"job": "j" * 100_000, "rank": 0, "epoch": 0, "credit": 1}).encode()
        ],
        {ErrorCode.MALFORMED},
    ),
    (
        "Hello nested 10k deep",
        [HEAD + b"\x01" + b'{"job":' + b"[" * 10_000 + b"]" * 10_000 + b"}"],
        {ErrorCode.MALFORMED},
    ),
    (
        "Credit with wrong version byte",
        [b"SS\x07\x04" + b'{"grant":1}'],
        {ErrorCode.VERSION_MISMATCH},
    ),
    ("Heartbeat with version 0", [b"SS\x00\x07{}"], {ErrorCode.VERSION_MISMATCH}),
    (
        "Credit with 10k slots",
        [HEAD + b"\x04" + json.dumps({"grant": 1, "slots": list(range(10_000))}).encode()],
        {ErrorCode.MALFORMED},
    ),
    ("Credit with negative grant", [HEAD + b"\x04" + b'{"grant":-5}'], {ErrorCode.MALFORMED}),
    ("Credit with non-UTF-8 body", [HEAD + b"\x04\xff\xfe\xfd"], {ErrorCode.MALFORMED}),
    ("kind 0", [HEAD + b"\x00{}"], {ErrorCode.UNKNOWN_MESSAGE}),
    ("kind 255", [HEAD + b"\xff{}"], {ErrorCode.UNKNOWN_MESSAGE}),
    (
        "batch header claiming 16 GiB, no payload",
        [_batch_header(1, (1 << 34,), 1 << 34)],
        {ErrorCode.MALFORMED},
    ),
    (
        "batch header claiming 2**62 bytes with a lying shape",
        [_batch_header(1, (1 << 31, 1 << 31), 1 << 62)],
        {ErrorCode.MALFORMED},
    ),
    (
        "batch header claiming 65535 parts",
        [_batch_header(0, (), 0)[:-2] + struct.pack("<H", 65535)],
        {ErrorCode.MALFORMED},
    ),
    ("batch header truncated", [_batch_header(1, (4,), 4)[:-5]], {ErrorCode.MALFORMED}),
    (
        "batch header with a 4-byte frame where 16 GiB are claimed",
        [_batch_header(1, (1 << 34,), 1 << 34), b"abcd"],
        {ErrorCode.MALFORMED},
    ),
    (
        "well-formed batch from a client",
        [_batch_header(1, (4,), 4), b"abcd"],
        {ErrorCode.UNKNOWN_MESSAGE},
    ),
    (
        "server-only Reject",
        encode(Reject(code=ErrorCode.INTERNAL, message="x")),
        {ErrorCode.UNKNOWN_MESSAGE},
    ),
    (
        "Welcome from a client",
        encode(
            Welcome(
                stream=1,
                nonce=0,
                job="x",
                rank=0,
                epoch=0,
                seed=0,
                start_batch=0,
                num_batches=1,
                heartbeat_s=1,
            )
        ),
        {ErrorCode.UNKNOWN_MESSAGE},
    ),
]


@pytest.mark.parametrize(("what", "frames", "codes"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_message_gets_a_typed_error(
    rel_server: ServerProc, baseline_rss: int, what: str, frames: list[bytes], codes: set[ErrorCode]
) -> None:
    """Each malformed or hostile message is answered with one typed, non-fatal Error (or Reject) and the same socket still works."""
    with zmq_context() as ctx:
        s = RawStream(ctx, rel_server.tcp_endpoint)
        s.send_raw(frames)
        replies = replies_until_barrier(s)
        assert len(replies) == 1, f"{what}: expected one reply, got {replies}"
        (r,) = replies
        assert isinstance(r, (Error, Reject)) and r.code in codes, f"{what}: {r!r}"
        if isinstance(r, Error):
            assert not r.fatal
        s.close()
    assert healthy(rel_server)


def test_over_limit_frame_drops_only_that_peer(rel_server: ServerProc, baseline_rss: int) -> None:
    """A 4 MiB message (over the 1 MiB incoming limit) drops that peer's connection; the server stays up and serves others."""
    with zmq_context() as ctx:
        evil = RawStream(ctx, rel_server.tcp_endpoint)
        evil.send_raw([HEAD + b"\x04" + b" " * (4 << 20)])
        # The peer gets no answer for it (libzmq refuses the message before Python sees it).
        assert not evil.sock.poll(500)
        assert_serves_an_epoch(rel_server, ctx)
        evil.close()
    assert healthy(rel_server)


def test_flood_of_1000_garbage_messages(rel_server: ServerProc, baseline_rss: int) -> None:
    """1,000 garbage messages from one peer each get an error (or the peer is dropped), the server stays up, RSS stays bounded, and a good stream completes an epoch."""
    rng = np.random.default_rng(0)
    kinds = [
        lambda: rng.bytes(int(rng.integers(0, 200))),
        lambda: HEAD + bytes([int(rng.integers(0, 256))]) + rng.bytes(int(rng.integers(0, 200))),
        lambda: _batch_header(1, (1 << 34,), 1 << 34),
        lambda: _hello_frame(job=f"nope-{rng.integers(1 << 30)}"),
        lambda: encode(Credit(grant=1))[0],
        lambda: encode(Heartbeat())[0],
        lambda: encode(EndOfEpoch(stream=1, epoch=0, num_batches=1))[0],
    ]
    with zmq_context() as ctx:
        s = RawStream(ctx, rel_server.tcp_endpoint)
        s.sock.setsockopt(zmq.RCVHWM, 0)
        t0 = time.monotonic()
        for i in range(1000):
            s.send_raw([kinds[i % len(kinds)]()])
        replies = replies_until_barrier(s, timeout=scaled(30.0))
        elapsed = time.monotonic() - t0
        assert len(replies) == 1000, f"{len(replies)} replies to 1000 messages"
        assert all(isinstance(r, (Error, Reject)) for r in replies)
        assert elapsed < scaled(30.0)
        s.close()
        assert_serves_an_epoch(rel_server, ctx)
    FUZZ_CASES["flood"] = 1000
    growth = rss_bytes(rel_server.proc.pid) - baseline_rss
    assert growth < RSS_SLACK, f"server RSS grew {growth / 2**20:.1f} MiB during the flood"


_kind_byte = st.integers(0, 255)
_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
_fields = st.sampled_from(
    [
        "job",
        "rank",
        "epoch",
        "credit",
        "grant",
        "slots",
        "nonce",
        "token",
        "protocols",
        "stats",
        "start_batch",
        "transport",
        "boot_id",
    ]
)
_bodies = st.one_of(
    st.binary(max_size=300),
    st.dictionaries(_fields, _json_values, max_size=6).map(lambda d: json.dumps(d).encode()),
    _json_values.map(lambda v: json.dumps(v).encode()),
)
_header = st.one_of(
    st.binary(max_size=8),
    st.tuples(st.sampled_from([b"SS", b"SX"]), st.integers(0, 3), _kind_byte, _bodies).map(
        lambda t: t[0] + bytes([t[1], t[2]]) + t[3]
    ),
    st.builds(
        lambda n, shape, nbytes, tail: _batch_header(n, shape, nbytes)[
            : len(_batch_header(n, shape, nbytes)) - tail
        ],
        st.integers(0, 3),
        st.lists(st.integers(0, 1 << 40), max_size=3).map(tuple),
        st.integers(0, 1 << 63),
        st.integers(0, 3),
    ),
)
_messages = st.lists(st.one_of(_header, st.binary(max_size=64)), min_size=1, max_size=3).flatmap(
    lambda rest: _header.map(lambda h: [h, *rest[1:]])
)


@pytest.fixture(scope="module")
def fuzz_socket(rel_server: ServerProc):
    with zmq_context() as ctx:
        s = RawStream(ctx, rel_server.tcp_endpoint)
        yield s
        s.close()


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(frames=_messages)
def test_random_frames_never_break_the_server(
    rel_server: ServerProc, baseline_rss: int, fuzz_socket: RawStream, frames: list[bytes]
) -> None:
    """Random frames (raw bytes, good prefixes with random bodies, lying batch headers) each get at most one typed reply and the server keeps answering."""
    FUZZ_CASES["hypothesis"] = FUZZ_CASES.get("hypothesis", 0) + 1
    fuzz_socket.send_raw(frames)
    replies = replies_until_barrier(fuzz_socket)
    assert len(replies) <= 1, replies
    for r in replies:
        assert isinstance(r, (Error, Reject)), r
        assert r.code != ErrorCode.INTERNAL, f"server failed internally on {frames!r}: {r!r}"


def test_server_intact_after_hostile_input(rel_server: ServerProc, baseline_rss: int) -> None:
    """After every hostile test above, the server is healthy, streams a full epoch, and its RSS grew boundedly."""
    with zmq_context() as ctx:
        assert_serves_an_epoch(rel_server, ctx)
    assert healthy(rel_server)
    growth = rss_bytes(rel_server.proc.pid) - baseline_rss
    print(
        f"\nwire fuzz cases: {FUZZ_CASES}; RSS baseline {baseline_rss / 2**20:.1f} MiB, growth {growth / 2**20:.1f} MiB"
    )
    assert growth < RSS_SLACK
    assert "Traceback" not in rel_server.log_tail(1 << 20)
