"""Streams: one live stream per (job, rank), stream limits, Hello rate, and shm rings
that count only once their client proved it mapped them. Real servers, raw DEALER peers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from shardserve.proto.errors import ErrorCode
from shardserve.proto.framing import peek_kind
from shardserve.proto.messages import Bye, EndOfEpoch, Error, Heartbeat, Hello, Kind, Welcome
from shardserve.server.streaming.streamer import liveness_s
from tests.server.rawclient import Batch, RawStream, zmq_context
from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, job_status, make_job, run_server
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]
# Stretched on a busy machine: a live client starved of CPU for a heartbeat or two must not
# look late.
HEARTBEAT_S = scaled(0.5)
#: ``--stream-timeout-s``: how long a silent connection lives (the ZMTP heartbeat timeout).
STREAM_TIMEOUT_S = scaled(3.0)
FENCE_S = liveness_s(HEARTBEAT_S, STREAM_TIMEOUT_S)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("limitstore")
    make_cifar_like(root, "cifar", n=200)
    return root


@pytest.fixture(scope="module")
def srv(store: Path) -> Iterator[ServerProc]:
    with run_server(
        store, "--heartbeat-s", str(HEARTBEAT_S), "--stream-timeout-s", str(STREAM_TIMEOUT_S)
    ) as s:
        yield s


_open: list[RawStream] = []


@pytest.fixture()
def ctx() -> Iterator[zmq.Context]:
    with zmq_context() as c:
        try:
            yield c
        finally:
            while _open:
                _open.pop().close()


def _peer(srv: ServerProc, ctx: zmq.Context) -> RawStream:
    s = RawStream(ctx, srv.data_endpoints[0])
    _open.append(s)
    return s


def _welcomed(s: RawStream) -> Welcome:
    msg = s.recv_kind(Welcome)
    assert isinstance(msg, Welcome)
    return msg


def _error(s: RawStream, timeout: float | None = None) -> Error:
    timeout = scaled(15.0) if timeout is None else timeout
    msg = s.recv_kind(Error, timeout=timeout)
    assert isinstance(msg, Error)
    return msg


def _keep_talking(s: RawStream, seconds: float) -> list[object]:
    """Heartbeat like a client waiting for data, collecting what arrives, for ``seconds``."""
    got: list[object] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.send(Heartbeat())
        if s.sock.poll(int(HEARTBEAT_S * 500)):
            got.append(s.recv())
    return got


def _read_all(s: RawStream) -> int:
    n = 0
    while True:
        msg = s.recv(what="a batch or EndOfEpoch")
        if isinstance(msg, Batch):
            n += 1
            s.grant(1)
        elif isinstance(msg, EndOfEpoch):
            return n


def _log(srv: ServerProc) -> str:
    return srv.log_path.read_text(errors="replace")


def test_second_claimant_of_a_live_rank_is_refused(srv: ServerProc, ctx: zmq.Context) -> None:
    """Two processes claiming rank 0 of a job whose holder is alive: the second gets a fatal
    RankInUse naming the rank, the world size and when the other stream opened; the holder
    keeps its whole epoch; the log says rank_conflict and the status page shows it."""
    job = make_job(srv, batch_size=10, world_size=2, seed=11)
    first, second = _peer(srv, ctx), _peer(srv, ctx)
    first.hello(job, rank=0, credit=1)
    welcome = _welcomed(first)
    second.hello(job, rank=0, credit=1)
    seen = _keep_talking(first, 1.0)  # the holder is waiting for data: it heartbeats
    err = _error(second)
    assert err.code is ErrorCode.RANK_IN_USE and err.fatal
    for fact in ("rank 0", "world size 2", "stream opened at", "RANK in 0..1"):
        assert fact in err.message, err.message
    first.grant(4)
    batches = sum(isinstance(m, Batch) for m in seen) + _read_all(first)
    assert batches == welcome.num_batches
    status = job_status(srv, job)
    (rank0,) = [r for r in status["ranks"] if r["rank"] == 0]
    assert "refused a second client" in rank0["conflict"]
    page = httpx.get(f"{srv.http_url}/", timeout=scaled(10)).text
    assert "rank conflict" in page
    log = _log(srv)
    assert "stream.rank_conflict" in log and "outcome=refused" in log
    opened = [ln for ln in log.splitlines() if "stream.opened" in ln and f"job={job}" in ln]
    assert len(opened) == 1, opened


def test_a_restarted_client_fences_its_dead_predecessor(srv: ServerProc, ctx: zmq.Context) -> None:
    """kill -9 then restart with the same rank: the dead holder's stream is reclaimed and the
    new client gets the rank, within the fence window, and its whole epoch."""
    job = make_job(srv, batch_size=10, world_size=2, seed=12)
    dead = _peer(srv, ctx)
    dead.hello(job, rank=1, credit=2)
    _welcomed(dead)
    dead.close()  # the process is gone: its connection drops without a Bye
    t0 = time.monotonic()
    new = _peer(srv, ctx)
    new.hello(job, rank=1, credit=2)
    welcome = _welcomed(new)
    assert time.monotonic() - t0 < FENCE_S + scaled(5.0)
    assert _read_all(new) == welcome.num_batches


def test_a_silent_but_connected_holder_keeps_its_rank(srv: ServerProc, ctx: zmq.Context) -> None:
    """A holder that says nothing (a loop computing) but whose libzmq answers ZMTP PINGs is
    alive: a claimant is refused with RankInUse once the holder's connection outlived the
    liveness window, and the holder still reads its whole epoch afterwards."""
    job = make_job(srv, batch_size=10, world_size=1, seed=13)
    quiet, new = _peer(srv, ctx), _peer(srv, ctx)
    quiet.hello(job, rank=0, credit=1)
    welcome = _welcomed(quiet)
    t0 = time.monotonic()
    new.hello(job, rank=0, credit=1)
    err = _error(new)
    assert err.code is ErrorCode.RANK_IN_USE and err.fatal
    assert time.monotonic() - t0 >= FENCE_S - 0.5  # decided by the connection, not silence
    first = quiet.recv_kind(Batch)  # its one credited batch, then the rest on credit
    quiet.grant(1)
    assert 1 + _read_all(quiet) == welcome.num_batches, first
    assert "outcome=refused" in _log(srv)


def test_same_peer_next_epoch_is_not_a_conflict(srv: ServerProc, ctx: zmq.Context) -> None:
    """A client's own next Hello (next epoch) replaces its stream: no conflict, no wait."""
    job = make_job(srv, batch_size=50, world_size=1, seed=14)
    s = _peer(srv, ctx)
    for epoch in range(3):
        s.hello(job, rank=0, epoch=epoch, credit=4)
        w = _welcomed(s)
        assert _read_all(s) == w.num_batches
    assert f"job={job}" not in "".join(ln for ln in _log(srv).splitlines() if "rank_conflict" in ln)


def test_stream_limits_refuse_with_the_setting_to_change(store: Path, ctx: zmq.Context) -> None:
    """Past --max-streams, or past --max-streams-per-job, a Hello gets a fatal stream_limit
    Error naming the flag; a freed place is taken again."""
    args = ("--max-streams", "2", "--max-streams-per-job", "1")
    with run_server(store, *args) as srv:
        a, b = make_job(srv, batch_size=10, world_size=2, seed=1), make_job(srv, 10, seed=2)
        p1, p2, p3, p4 = (_peer(srv, ctx) for _ in range(4))
        p1.hello(a, rank=0, credit=1)
        _welcomed(p1)
        p2.hello(a, rank=1, credit=1)
        err = _error(p2)
        assert err.code is ErrorCode.STREAM_LIMIT and err.fatal
        assert "--max-streams-per-job 1" in err.message and f"job {a}" in err.message
        p3.hello(b, rank=0, credit=1)
        _welcomed(p3)
        c = make_job(srv, 10, seed=3)
        p4.hello(c, rank=0, credit=1)
        err = _error(p4)
        assert err.code is ErrorCode.STREAM_LIMIT and "--max-streams" in err.message
        p1.send(Bye())
        time.sleep(0.3)
        p4.hello(c, rank=0, credit=1)
        _welcomed(p4)


def test_hello_flood_is_rate_limited(store: Path, ctx: zmq.Context) -> None:
    """A peer sending more Hellos a second than --max-hellos-per-s gets non-fatal stream_limit
    errors for the superseded excess, is served its newest Hello, and another peer is served
    as usual."""
    with run_server(store, "--max-hellos-per-s", "5") as srv:
        job = make_job(srv, batch_size=10, world_size=2, seed=4)
        flood, good = _peer(srv, ctx), _peer(srv, ctx)
        for i in range(30):
            flood.hello(job, rank=0, credit=1, nonce=i)
        errors: list[Error] = []
        end = time.monotonic() + scaled(5)
        while time.monotonic() < end and len(errors) < 20:
            if flood.sock.poll(500):
                msg = flood.recv()
                if isinstance(msg, Error):
                    errors.append(msg)
        assert len(errors) >= 20
        assert all(e.code is ErrorCode.STREAM_LIMIT and not e.fatal for e in errors)
        assert "--max-hellos-per-s" in errors[0].message
        while True:  # the flood's newest Hello is still served, once its peer has a token
            msg = flood.recv(what="the Welcome of the last Hello")
            if isinstance(msg, Welcome) and msg.nonce == 29:
                break
        good.hello(job, rank=1, credit=2)
        w = _welcomed(good)
        assert _read_all(good) == w.num_batches
        assert "peer.hello_limited" in _log(srv)


def test_hellos_are_answered_in_the_order_sent(store: Path, ctx: zmq.Context) -> None:
    """A Hello that gets a token while an older one of its peer still waits supersedes it: the older
    is answered first (stream_limit), never admitted after the newer one."""
    # Admitting the older after the newer would replace the newer stream. Rare ticks keep the older
    # one waiting past the refill.
    with run_server(
        store, "--max-hellos-per-s", "1", "--heartbeat-s", "60", "--stream-timeout-s", "3600"
    ) as srv:
        p = _peer(srv, ctx)
        names = ["order-a", "order-b", "order-c"]
        p.send(Hello(job=names[0], rank=0, epoch=0, credit=1, transport="socket"))
        p.send(Hello(job=names[1], rank=0, epoch=0, credit=1, transport="socket"))  # no token
        time.sleep(1.5)  # the peer's token is back; the server's next tick is seconds away
        p.send(Hello(job=names[2], rank=0, epoch=0, credit=1, transport="socket"))
        answered: list[str] = []
        while not answered or answered[-1] != names[2]:
            # A slow server may defer the last Hello too: then it is answered at a tick (15 s).
            err = _error(p, timeout=scaled(40.0))
            if err.code is ErrorCode.STREAM_LIMIT:
                answered.append(names[1])  # only the waiting Hello can be superseded
            else:
                assert err.code is ErrorCode.JOB_NOT_FOUND, err
                answered.append(next(n for n in names if repr(n) in err.message))
        assert answered == names, f"answered in the order {answered}"


def _shm_hello(job: str, rank: int, boot: str) -> Hello:
    return Hello(job=job, rank=rank, epoch=0, credit=2, transport="auto", boot_id=boot)


def _boot_id(srv: ServerProc) -> str:
    return str(httpx.get(f"{srv.http_url}/v1/info", timeout=scaled(10)).json()["boot_id"])


def test_unmapped_rings_are_capped_and_proof_frees_the_place(store: Path, ctx: zmq.Context) -> None:
    """A peer claiming this host's boot id gets a ring; while it never Credits (never proves it
    mapped the ring), a second such ring is refused (--shm-unproven-rings 1) and that stream
    uses the socket; after the first peer's Credit a new stream gets shared memory again."""
    with run_server(store, "--shm-unproven-rings", "1") as srv:
        if not Path("/dev/shm").is_dir():
            pytest.skip("no /dev/shm on this host")
        job = make_job(srv, batch_size=10, world_size=3, seed=5)
        boot = _boot_id(srv)
        ghost, other, late = _peer(srv, ctx), _peer(srv, ctx), _peer(srv, ctx)
        ghost.send(_shm_hello(job, 0, boot))
        assert _welcomed(ghost).transport == "shm"
        other.send(_shm_hello(job, 1, boot))
        assert _welcomed(other).transport == "socket"
        assert "--shm-unproven-rings" in _log(srv)
        ghost.grant(1)  # its first Credit: the ring is proven
        ghost.send(Heartbeat())  # answered after the Credit was handled (one peer, in order)
        while True:
            assert ghost.sock.poll(int(scaled(15.0) * 1000)), "no Heartbeat reply from the server"
            if peek_kind(ghost.sock.recv_multipart()[0]) is Kind.HEARTBEAT:
                break
        late.send(_shm_hello(job, 2, boot))
        assert _welcomed(late).transport == "shm"


SECOND_LOADER = """
import sys
from shardserve.client import Loader
from shardserve.proto.errors import RankInUse
url = sys.argv[1]
with Loader(url, "cifar", 2, seed=21, rank=0, world_size=2, prefetch=2, timeout=30.0,
            transport="socket") as loader:
    loader.set_epoch(0)
    try:
        next(iter(loader))
    except RankInUse as e:
        print("RankInUse:", e)
        sys.exit(3)
print("got a batch")
"""


def test_a_second_process_on_a_live_rank_raises_rank_in_use(srv: ServerProc) -> None:
    """Through the real client: while one Loader reads rank 0, a Loader for rank 0 in another
    process raises RankInUse (typed, well within its deadline) and the first reads its whole
    epoch."""
    from shardserve.client import Loader

    kw = {"seed": 21, "rank": 0, "world_size": 2, "timeout": 30.0, "transport": "socket"}
    got: list[int] = []
    failure: list[BaseException] = []

    def first_reads() -> None:
        try:
            with Loader(srv.http_url, "cifar", 2, prefetch=2, **kw) as first:
                first.set_epoch(0)
                for batch in first:  # 50 batches, ~12 s: the second process starts meanwhile
                    got.append(len(batch["label"]))
                    time.sleep(0.25)  # computing, and reading again: alive
        except BaseException as e:  # reported in the main thread
            failure.append(e)

    reader = threading.Thread(target=first_reads)
    reader.start()
    deadline = time.monotonic() + scaled(15)
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got, "the first Loader received no batch"
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    second = subprocess.run(
        [sys.executable, "-c", SECOND_LOADER, srv.http_url],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        env=env,
        cwd=ROOT,
    )
    assert second.returncode == 3, second.stdout + second.stderr
    assert "rank 0" in second.stdout and "world size 2" in second.stdout
    assert time.monotonic() - t0 < scaled(30.0)
    reader.join(timeout=scaled(60))
    assert not failure, failure
    assert sum(got) == 100  # rank 0's half of 200 samples, every batch


def test_a_new_stream_of_the_same_process_replaces_its_old_one(
    srv: ServerProc, ctx: zmq.Context
) -> None:
    """A Hello saying it comes from the holder's own process (same boot id and pid: a new
    Loader, a reconnect on a new socket) takes the rank at once, without a conflict."""
    job = make_job(srv, batch_size=10, world_size=1, seed=15)
    old, new = _peer(srv, ctx), _peer(srv, ctx)
    me = {"boot_id": "client-boot", "pid": 4242}
    old.hello(job, rank=0, credit=1, **me)
    _welcomed(old)
    _keep_talking(old, 0.2)
    t0 = time.monotonic()
    new.hello(job, rank=0, credit=2, **me)
    w = _welcomed(new)
    assert time.monotonic() - t0 < FENCE_S  # no wait for silence
    assert _read_all(new) == w.num_batches
    conflicts = [ln for ln in _log(srv).splitlines() if "rank_conflict" in ln and job in ln]
    assert conflicts == []
