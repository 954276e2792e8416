"""A many-stream load generator on raw DEALER sockets: one thread, one ``zmq.Poller``.

Used by ``test_load.py`` (small, CI) and ``bench/bench_load.py`` (larger). Each stream is one
(job, rank); the consumer is infinitely fast (every batch's credit goes straight back), and at
``EndOfEpoch`` the stream says Hello for the next epoch on the same socket, so every stream is
busy for the whole run. Batch headers are decoded and checked (stream id, epoch, index order);
payloads are not copied.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

import httpx
import zmq

from shardserve.proto.framing import decode, decode_batch, encode, peek_kind
from shardserve.proto.messages import (
    Credit,
    EndOfEpoch,
    Error,
    Heartbeat,
    Hello,
    Kind,
    Reject,
    Welcome,
)
from tests.support.server import ServerProc
from tests.support.slowness import scaled


@dataclass
class StreamLoad:
    job: str
    rank: int
    sock: zmq.Socket
    epoch: int = 0
    nonce: int = 0
    stream: int | None = None
    next_index: int = 0
    batches: int = 0
    bytes: int = 0
    epochs_done: int = 0
    errors: list[str] = field(default_factory=list)
    first_batch_at: float | None = None


@dataclass
class LoadResult:
    streams: int
    seconds: float
    rates: list[float]  # batches/s per stream
    bytes_per_s: float
    epochs: int
    errors: list[str]
    rss_start: int
    rss_end: int
    #: The server's RSS before any stream of this run opened.
    rss_idle: int = 0

    @property
    def mean_rate(self) -> float:
        return sum(self.rates) / len(self.rates)

    @property
    def fairness(self) -> float:
        """Slowest stream's rate over the mean rate (1.0 is perfectly fair)."""
        return min(self.rates) / self.mean_rate if self.mean_rate > 0 else 0.0

    def summary(self) -> dict[str, object]:
        return {
            "streams": self.streams,
            "seconds": round(self.seconds, 2),
            "total_batches_per_s": round(sum(self.rates), 1),
            "mean_batches_per_s": round(self.mean_rate, 2),
            "min_batches_per_s": round(min(self.rates), 2),
            "max_batches_per_s": round(max(self.rates), 2),
            "min_over_mean": round(self.fairness, 3),
            "mb_per_s": round(self.bytes_per_s / 1e6, 1),
            "epochs_completed": self.epochs,
            "errors": len(self.errors),
            "rss_idle_mb": round(self.rss_idle / 2**20, 1),
            "rss_start_mb": round(self.rss_start / 2**20, 1),
            "rss_end_mb": round(self.rss_end / 2**20, 1),
            "rss_growth_mb": round((self.rss_end - self.rss_start) / 2**20, 1),
        }


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def create_jobs(srv: ServerProc, specs: list[dict]) -> list[str]:
    out = []
    for spec in specs:
        r = httpx.post(
            f"{srv.http_url}/v1/jobs", json=spec, headers=srv.headers, timeout=scaled(10)
        )
        r.raise_for_status()
        out.append(str(r.json()["id"]))
    return out


def _hello(s: StreamLoad, credit: int) -> None:
    s.nonce = secrets.randbits(62)
    s.stream = None
    s.next_index = 0
    hello = Hello(
        job=s.job, rank=s.rank, epoch=s.epoch, credit=credit, nonce=s.nonce, transport="socket"
    )
    s.sock.send_multipart(encode(hello))


def run_load(
    srv: ServerProc,
    jobs: list[tuple[str, int]],
    seconds: float,
    credit: int = 4,
    warmup_s: float = 1.0,
    endpoint: str | None = None,
) -> LoadResult:
    """Stream every (job, world_size) rank for ``warmup_s`` + ``seconds``; rates count only the
    measured ``seconds``. RSS is read after the warm-up (start) and at the end."""
    ctx = zmq.Context()
    streams: list[StreamLoad] = []
    poller = zmq.Poller()
    by_sock: dict[zmq.Socket, StreamLoad] = {}
    rss_idle = rss_bytes(srv.proc.pid)
    try:
        for job, world in jobs:
            for rank in range(world):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint or srv.tcp_endpoint)
                s = StreamLoad(job, rank, sock)
                streams.append(s)
                by_sock[sock] = s
                poller.register(sock, zmq.POLLIN)
                _hello(s, credit)
        t_start = time.monotonic()
        t_measure = t_start + warmup_s
        t_end = t_measure + seconds
        measuring = False
        rss_start = rss_bytes(srv.proc.pid)
        counted: dict[int, int] = {}
        while True:
            now = time.monotonic()
            if not measuring and now >= t_measure:
                measuring = True
                rss_start = rss_bytes(srv.proc.pid)
                counted = {id(s): s.batches for s in streams}
                bytes_start = sum(s.bytes for s in streams)
            if now >= t_end:
                break
            for sock, _ in poller.poll(
                max(1, int((min(t_end, t_measure if not measuring else t_end) - now) * 1000))
            ):
                s = by_sock[sock]
                for _ in range(64):  # bounded burst per socket per poll
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    _handle(s, frames, credit)
        rss_end = rss_bytes(srv.proc.pid)
        elapsed = time.monotonic() - t_measure
        rates = [(s.batches - counted.get(id(s), 0)) / elapsed for s in streams]
        nbytes = sum(s.bytes for s in streams) - bytes_start
        return LoadResult(
            streams=len(streams),
            seconds=elapsed,
            rates=rates,
            bytes_per_s=nbytes / elapsed,
            epochs=sum(s.epochs_done for s in streams),
            errors=[e for s in streams for e in s.errors],
            rss_start=rss_start,
            rss_end=rss_end,
            rss_idle=rss_idle,
        )
    finally:
        for s in streams:
            s.sock.close(linger=0)
        ctx.term()


def _handle(s: StreamLoad, frames: list[zmq.Frame], credit: int) -> None:
    if peek_kind(frames[0].buffer) is Kind.BATCH:
        header, _ = decode_batch([f.buffer for f in frames])
        if header.stream != s.stream or header.epoch != s.epoch:
            return  # a replaced stream's batch
        if header.index != s.next_index:
            s.errors.append(f"{s.job}/{s.rank}: batch {header.index}, expected {s.next_index}")
        s.next_index = header.index + 1
        s.batches += 1
        s.bytes += header.nbytes
        s.sock.send_multipart(encode(Credit(grant=1)))
        return
    msg = decode([f.bytes for f in frames])
    if isinstance(msg, Welcome):
        if msg.nonce == s.nonce:
            s.stream = msg.stream
    elif isinstance(msg, EndOfEpoch):
        if msg.stream == s.stream:
            if s.next_index != msg.num_batches:
                s.errors.append(
                    f"{s.job}/{s.rank}: EndOfEpoch after {s.next_index} of {msg.num_batches}"
                )
            s.epochs_done += 1
            s.epoch += 1
            _hello(s, credit)
    elif isinstance(msg, (Error, Reject)):
        s.errors.append(f"{s.job}/{s.rank}: {msg!r}")
    elif not isinstance(msg, Heartbeat):
        s.errors.append(f"{s.job}/{s.rank}: unexpected {msg!r}")
