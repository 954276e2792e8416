"""What the benchmark scripts share: a real server, a cifar-like dataset, raw data-plane peers.

Each ``bench/bench_*.py`` runs as a script (``python bench/bench_x.py``), so this folder is on
its import path and ``from _support import run_server`` needs no ``sys.path`` edit. The
benchmarks import nothing from ``tests/``; the test suite imports this harness instead
(``tests/support``), passing ``slowness`` so that its waits stretch on a busy machine, where a
benchmark keeps the fixed ones.

::

    with tempfile.TemporaryDirectory() as tmp:
        make_cifar_like(Path(tmp), "cifar", n=5000)
        with run_server(Path(tmp)) as srv:          # ephemeral ports, ipc socket in a tmp dir
            job = make_job(srv, batch_size=256)
            res = run_load(srv, [(job, 1)], seconds=5)   # one raw DEALER per rank, one thread
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import zmq

from shardserve.proto.framing import decode, decode_batch, encode, peek_kind
from shardserve.proto.manifest import FieldSpec, Manifest
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
from shardserve.server.store.write.writer import ShardWriter

# -- a server ------------------------------------------------------------------------------
_TERM_GRACE_S = 5.0


@dataclass
class ServerProc:
    """A running server subprocess and how to reach it."""

    http_url: str
    #: Every bound data endpoint: the tcp ones first, then the ipc one.
    data_endpoints: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path
    token: str | None = None
    ready: dict[str, object] = field(default_factory=dict)
    #: What every wait of this harness is multiplied by: 1 for a benchmark, the measured
    #: slowness of a busy machine for the test suite (``tests/support``).
    slowness: float = 1.0

    @property
    def tcp_endpoint(self) -> str:
        return next(e for e in self.data_endpoints if e.startswith("tcp://"))

    @property
    def ipc_endpoint(self) -> str | None:
        return next((e for e in self.data_endpoints if e.startswith("ipc://")), None)

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers that authenticate against this server (empty without a token)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def log_tail(self, nbytes: int = 4000) -> str:
        """The last ``nbytes`` of the server's stdout+stderr."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "<no log>"
        return data[-nbytes:].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL the server (a crash, for restart tests) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=_TERM_GRACE_S * self.slowness)

    def terminate(self, timeout: float | None = None) -> int:
        """SIGTERM the server and return its exit code; SIGKILL if it outlives ``timeout``
        (default 5 s times ``slowness``)."""
        timeout = _TERM_GRACE_S * self.slowness if timeout is None else timeout
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=_TERM_GRACE_S * self.slowness)
            raise AssertionError(
                f"server pid {self.proc.pid} did not exit within {timeout} s of SIGTERM; "
                f"log tail:\n{self.log_tail()}"
            ) from None


def _token_from(args: tuple[str, ...], env: Mapping[str, str] | None) -> str | None:
    for i, a in enumerate(args):
        if a == "--token" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--token="):
            return a.split("=", 1)[1]
    return (env or {}).get("SHARDSERVE_TOKEN")


def _wait_ready(
    srv_dir: Path,
    proc: subprocess.Popen[bytes],
    log: Path,
    token: str | None,
    timeout: float,
    slowness: float,
) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    ready_file = srv_dir / "ready.json"
    waited_for = f"ready file {ready_file}"
    info: dict[str, object] = {}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    delay = 0.01
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if not info and ready_file.exists():
            info = json.loads(ready_file.read_text())
            waited_for = f"GET {info['http']}/readyz == 200"
        if info:
            try:
                r = httpx.get(f"{info['http']}/readyz", headers=headers, timeout=slowness)
                if r.status_code == 200:
                    return info
            except httpx.TransportError:
                pass
        time.sleep(delay)  # polling a readiness condition with a deadline, not a fixed wait
        delay = min(delay * 2, 0.1)
    status = f"exited with {proc.returncode}" if proc.poll() is not None else "still running"
    tail = log.read_bytes()[-4000:].decode(errors="replace") if log.exists() else ""
    raise AssertionError(
        f"server pid {proc.pid} not ready after {timeout} s (waited for {waited_for}; "
        f"process {status}); log tail:\n{tail}"
    )


@contextmanager
def run_server(
    store: Path,
    *extra_args: str,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    http_port: int = 0,
    data_port: int = 0,
    workdir: Path | None = None,
    slowness: float = 1.0,
) -> Iterator[ServerProc]:
    """Run ``shardserve serve`` on ``store`` until the block exits.

    ``http_port``/``data_port`` 0 pick ephemeral ports; pass :func:`_ports.free_port` values to
    start a second server on the same ports after the first died. ``workdir`` holds the ready
    file, the log and the ipc socket (a fresh temporary folder by default; pass the same one
    to keep the ipc path across a restart). ``env`` is added to the current environment.
    ``timeout`` (default 20 s) bounds the wait for readiness. The store folder is created if
    missing (``--create``). On exit the server gets SIGTERM (then SIGKILL after 5 s) and must
    be gone. ``slowness`` multiplies every one of these waits (the test suite passes its
    measure of a busy machine).
    """
    timeout = 20.0 * slowness if timeout is None else timeout
    own_tmp = None
    if workdir is None:
        # /tmp, not pytest's tmp_path: an ipc:// path must stay under the ~100-byte sun_path limit.
        own_tmp = tempfile.TemporaryDirectory(prefix="ss-")
        workdir = Path(own_tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "ready.json").unlink(missing_ok=True)
    log_path = workdir / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "shardserve.server",
        "serve",
        "--store",
        str(store),
        "--http",
        f"127.0.0.1:{http_port}",
        "--data",
        f"tcp://127.0.0.1:{data_port}",
        "--ipc",
        str(workdir / "ss.sock"),
        "--ready-file",
        str(workdir / "ready.json"),
        "--create",
        *extra_args,
    ]
    full_env = {**os.environ, **(env or {})}
    token = _token_from(extra_args, env)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    srv = ServerProc("", [], proc, log_path, token, slowness=slowness)
    try:
        info = _wait_ready(workdir, proc, log_path, token, timeout, slowness)
        srv.http_url = str(info["http"])
        srv.data_endpoints = [str(e) for e in info["data_endpoints"]]  # type: ignore[attr-defined]
        srv.ready = info
        yield srv
    finally:
        if proc.poll() is None:
            srv.terminate()
        assert proc.poll() is not None, f"server pid {proc.pid} is still running"
        if own_tmp is not None:
            own_tmp.cleanup()


def make_job(srv: ServerProc, batch_size: int = 64, **spec: object) -> str:
    """POST a job for ``srv``'s cifar-like dataset (override with ``dataset=``); its id."""
    body = {"dataset": "cifar", "batch_size": batch_size, **spec}
    r = httpx.post(
        f"{srv.http_url}/v1/jobs", json=body, headers=srv.headers, timeout=10 * srv.slowness
    )
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


# -- data ----------------------------------------------------------------------------------
CIFAR_FIELDS = (
    FieldSpec(name="image", dtype="uint8", shape=(3, 32, 32)),
    FieldSpec(name="label", dtype="int64", shape=()),
)


def cifar_images(start: int, stop: int, seed: int = 0) -> np.ndarray:
    """Images of samples ``start..stop-1``, ``uint8[stop-start, 3, 32, 32]``: the first 4 bytes
    of each are its index (little-endian ``uint32``), the rest pseudo-random from ``(seed, i)``."""
    n = stop - start
    flat = np.empty((n, 3 * 32 * 32), dtype=np.uint8)
    for j, i in enumerate(range(start, stop)):
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, i])))
        flat[j] = rng.integers(0, 256, size=flat.shape[1], dtype=np.uint8)
    flat[:, :4] = np.arange(start, stop, dtype="<u4").view(np.uint8).reshape(n, 4)
    return flat.reshape(n, 3, 32, 32)


def make_cifar_like(
    root: str | Path, name: str = "cifar", n: int = 1000, seed: int = 0, shard_bytes: int = 1 << 20
) -> Manifest:
    """Write a cifar-like dataset of ``n`` samples (about 3 KiB each; 1 MiB shards by default)."""
    with ShardWriter(root, name, fields=CIFAR_FIELDS, shard_bytes=shard_bytes) as w:
        for start in range(0, n, 1024):
            stop = min(n, start + 1024)
            labels = np.arange(start, stop, dtype=np.int64) % 10
            w.add_batch({"image": cifar_images(start, stop, seed), "label": labels})
    return w.manifest


# -- raw data-plane peers ------------------------------------------------------------------
@contextmanager
def zmq_context() -> Iterator[zmq.Context]:
    """A ZeroMQ context destroyed (linger 0) when the block exits."""
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


class RawStream:
    """One DEALER connected to a server endpoint that says Hello and then reads nothing."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def hello(self, job: str, rank: int = 0, epoch: int = 0, credit: int = 4) -> None:
        hello = Hello(job=job, rank=rank, epoch=epoch, credit=credit, transport="socket")
        self.sock.send_multipart(encode(hello))

    def close(self) -> None:
        self.sock.close(linger=0)


# -- many streams from one thread (bench_load.py) ------------------------------------------
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
    """POST each job spec; their ids, in order."""
    out = []
    for spec in specs:
        r = httpx.post(
            f"{srv.http_url}/v1/jobs", json=spec, headers=srv.headers, timeout=10 * srv.slowness
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
