"""A raw pyzmq DEALER speaking ``shardserve.proto`` — the test's view of the data plane.

Deliberately not the real client: tests check the server against the protocol itself.
Every receive has a deadline and says what it waited for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import zmq

from shardserve.proto.dtypes import ITEMSIZE
from shardserve.proto.framing import decode, decode_batch, encode, peek_kind
from shardserve.proto.messages import (
    BatchHeader,
    Credit,
    EndOfEpoch,
    Heartbeat,
    Hello,
    Kind,
    Message,
)
from tests.support.slowness import scaled

#: How long a receive waits by default on an idle machine (stretched by :func:`scaled`).
RECV_TIMEOUT_S = 15.0


@dataclass
class Batch:
    header: BatchHeader
    parts: dict[str, np.ndarray]


def parts_of(header: BatchHeader, payload: list[zmq.Frame]) -> dict[str, np.ndarray]:
    """Arrays of a batch, copied out of the frames (so they outlive them)."""
    out = {}
    for p, f in zip(header.parts, payload, strict=True):
        arr = np.frombuffer(f.buffer if hasattr(f, "buffer") else f, dtype=p.dtype)
        assert arr.size * ITEMSIZE[p.dtype] == p.nbytes
        out[p.name] = arr.reshape(p.shape).copy()
    return out


class RawStream:
    """One DEALER connected to a server endpoint."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, msg: object) -> None:
        self.sock.send_multipart(encode(msg))  # type: ignore[arg-type]

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def hello(self, job: str, rank: int = 0, epoch: int = 0, credit: int = 4, **kw: object) -> None:
        self.send(Hello(job=job, rank=rank, epoch=epoch, credit=credit, transport="socket", **kw))

    def grant(self, n: int) -> None:
        self.send(Credit(grant=n))

    def recv(self, timeout: float | None = None, what: str = "a message") -> Message | Batch:
        """The next message; ``timeout`` (default :data:`RECV_TIMEOUT_S` stretched by this
        machine's slowness) bounds the wait for it."""
        timeout = scaled(RECV_TIMEOUT_S) if timeout is None else timeout
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no message from the server within {timeout} s (waited for {what})")
        frames = self.sock.recv_multipart(copy=False)
        if peek_kind(frames[0].buffer) is Kind.BATCH:
            header, payload = decode_batch(frames)
            return Batch(header, parts_of(header, payload))
        return decode([f.bytes for f in frames])

    def recv_kind(
        self, cls: type, timeout: float | None = None, skip_heartbeats: bool = True
    ) -> object:
        """The next message, which must be a ``cls`` (server heartbeats skipped)."""
        while True:
            msg = self.recv(timeout, what=cls.__name__)
            if skip_heartbeats and isinstance(msg, Heartbeat) and cls is not Heartbeat:
                continue
            assert isinstance(msg, cls), f"expected {cls.__name__}, got {msg!r}"
            return msg

    def read_epoch(self, grant_each: int = 1) -> tuple[list[Batch], EndOfEpoch]:
        """Receive batches (granting ``grant_each`` back per batch) until EndOfEpoch."""
        batches: list[Batch] = []
        while True:
            msg = self.recv(what=f"batch {len(batches)} or EndOfEpoch")
            if isinstance(msg, Batch):
                batches.append(msg)
                self.grant(grant_each)
            elif isinstance(msg, EndOfEpoch):
                return batches, msg
            elif not isinstance(msg, Heartbeat):
                raise AssertionError(f"unexpected message while reading an epoch: {msg!r}")

    def drain_until_heartbeat(self) -> list[Batch]:
        """Ping the server and collect what arrives before its Heartbeat reply.

        The server answers in order on one socket, so anything it had decided to send before
        it read the ping arrives first.
        """
        self.send(Heartbeat())
        got: list[Batch] = []
        while True:
            msg = self.recv(what="the server's Heartbeat reply")
            if isinstance(msg, Heartbeat):
                return got
            assert isinstance(msg, Batch), f"unexpected {msg!r}"
            got.append(msg)

    def close(self) -> None:
        self.sock.close(linger=0)


@contextmanager
def zmq_context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)
