"""Data plane: one peer's trouble stays that peer's; a dead data plane says so."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import zmq

from shardserve.client.connection import read_boot_id
from shardserve.proto.framing import encode
from shardserve.proto.manifest import FieldSpec
from shardserve.proto.messages import EndOfEpoch, Error, Hello, Welcome
from shardserve.server.store.write.writer import ShardWriter
from tests.server.rawclient import Batch, RawStream, zmq_context
from tests.support.data import make_cifar_like, sample_id_of
from tests.support.server import ServerProc, make_job, run_server
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dpstore")
    make_cifar_like(root, "cifar", n=400, shard_bytes=256 << 10)
    # Many tiny samples: planning an epoch of it takes real time (the Hello-flood case).
    fields = [FieldSpec(name="v", dtype="int32", shape=())]
    with ShardWriter(root, "many", fields=fields) as w:
        w.add_batch({"v": np.arange(3_000_000, dtype=np.int32)})
    return root


@pytest.fixture(scope="module")
def srv(store: Path, tmp_path_factory: pytest.TempPathFactory):
    state = tmp_path_factory.mktemp("dpstate")
    with run_server(store, "--state-dir", str(state), "--heartbeat-s", "0.5") as s:
        yield s


def _full_epoch(
    srv: ServerProc, ctx: zmq.Context, job: str, timeout: float | None = None
) -> list[int]:
    """Sample ids of one whole epoch of ``job`` read by a raw stream; fails on any gap."""
    timeout = scaled(10.0) if timeout is None else timeout
    s = RawStream(ctx, srv.tcp_endpoint)
    try:
        s.hello(job, credit=4)
        assert isinstance(s.recv_kind(Welcome, timeout=timeout), Welcome)
        ids: list[int] = []
        while True:
            msg = s.recv(timeout=timeout, what="a batch of the unaffected job")
            if isinstance(msg, Batch):
                ids += sample_id_of(msg.parts).tolist()
                s.grant(1)
            elif isinstance(msg, EndOfEpoch):
                return ids
            else:
                assert not isinstance(msg, Error), msg
    finally:
        s.close()


def _healthy(srv: ServerProc) -> None:
    assert srv.proc.poll() is None, srv.log_tail()
    r = httpx.get(f"{srv.http_url}/readyz", timeout=scaled(5))
    assert r.status_code == 200, r.text
    assert "streamer.crashed" not in srv.log_tail(200_000)


def test_peers_vanishing_between_hello_and_welcome_hurt_nobody(srv: ServerProc) -> None:
    """Same-host peers asking for shared memory that vanish right after their Hello (before the Welcome) leave the data plane serving: another job reads a whole epoch exactly once."""
    job = make_job(srv, batch_size=8, seed=101)
    other = make_job(srv, batch_size=20, seed=102)
    endpoint = srv.ipc_endpoint or srv.tcp_endpoint
    with zmq_context() as ctx:
        for i in range(40):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            hello = Hello(
                job=job,
                rank=0,
                epoch=i,
                credit=4,
                transport="auto",
                boot_id=read_boot_id(),
                pid=os.getpid(),
            )
            sock.send_multipart(encode(hello))
            if i % 2:
                time.sleep(0.005)  # some land mid-prepare, some right away
            sock.close(linger=0)
        ids = _full_epoch(srv, ctx, other)
    assert sorted(ids) == list(range(400))
    _healthy(srv)


def test_oversized_batches_are_refused_at_job_creation(srv: ServerProc) -> None:
    """A batch larger than the dataset with drop_last=True (no batch would be left), or over the byte limit, is a 422 naming the bound when the job is created; the data plane never sees it."""
    body = {"dataset": "cifar", "batch_size": 2**20, "drop_last": True}
    r = httpx.post(f"{srv.http_url}/v1/jobs", json=body, timeout=scaled(10))
    assert r.status_code == 422, r.text
    assert "larger than the dataset (400 samples)" in r.json()["detail"]
    assert "drop_last=False" in r.json()["detail"]
    _healthy(srv)


def test_byte_limit_is_configurable(store: Path) -> None:
    """``--max-batch-bytes`` bounds a batch's bytes: under it a job is created, over it 422."""
    with run_server(store, "--max-batch-bytes", str(100 * 3200)) as s:
        ok = httpx.post(
            f"{s.http_url}/v1/jobs", json={"dataset": "cifar", "batch_size": 64}, timeout=scaled(10)
        )
        assert ok.status_code in (200, 201), ok.text
        r = httpx.post(
            f"{s.http_url}/v1/jobs",
            json={"dataset": "cifar", "batch_size": 200},
            timeout=scaled(10),
        )
        assert r.status_code == 422 and "--max-batch-bytes" in r.json()["detail"], r.text


def test_a_batch_size_over_a_small_split_is_one_short_batch_as_in_a_dataloader(
    store: Path,
) -> None:
    """With drop_last=False, batch_size 2**20 over 400 samples is what DistributedSampler and
    DataLoader give: each of 3 ranks one batch of its 134 ids (padded from the start), and the
    server sizes that batch by those 134 rows: --max-batch-bytes (200 samples) admits it."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from shardserve.client import Loader

    world, n = 3, 400
    with run_server(store, "--max-batch-bytes", str(200 * 3200)) as s, zmq_context() as ctx:
        spec = {"batch_size": 2**20, "world_size": world, "shuffle": "none"}
        job = make_job(s, **spec)
        for rank in range(world):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False)
            (want,) = [b.tolist() for b in DataLoader(range(n), batch_size=2**20, sampler=sampler)]
            stream = RawStream(ctx, s.tcp_endpoint)
            stream.hello(job, rank=rank, credit=2)
            welcome = stream.recv_kind(Welcome)
            assert welcome.num_batches == 1, welcome  # type: ignore[attr-defined]
            batch = stream.recv_kind(Batch)
            assert isinstance(batch, Batch)
            assert sample_id_of(batch.parts).tolist() == want and len(want) == 134, rank
            assert isinstance(stream.recv_kind(EndOfEpoch), EndOfEpoch)
            stream.close()
        kw = {"rank": 2, "world_size": world, "shuffle": "none", "timeout": scaled(30.0)}
        with Loader(s.http_url, "cifar", 2**20, **kw) as loader:  # the client: the same batch
            assert len(loader) == 1
            (only,) = list(loader)
            assert isinstance(only["label"], torch.Tensor) and len(only["label"]) == 134


def test_hello_flood_does_not_starve_another_job(srv: ServerProc) -> None:
    """One peer saying Hello for 150 epochs of a 3M-sample job (each replacing the last) does not delay another job's stream: its whole epoch arrives with no gap over 5 s, and the flooding peer is welcomed for its last Hello."""
    flood_job = make_job(srv, dataset="many", batch_size=1000, seed=7)
    other = make_job(srv, batch_size=10, seed=103)
    with zmq_context() as ctx:
        flood = RawStream(ctx, srv.tcp_endpoint)
        for epoch in range(150):
            flood.hello(flood_job, epoch=epoch, credit=1)
        t0 = time.monotonic()
        ids = _full_epoch(srv, ctx, other, timeout=scaled(5.0))
        assert sorted(ids) == list(range(400))
        assert time.monotonic() - t0 < scaled(15.0)
        last = None
        deadline = time.monotonic() + scaled(30)
        while time.monotonic() < deadline:
            msg = flood.recv(timeout=scaled(30), what="the Welcome of the flood's last Hello")
            if isinstance(msg, Welcome):
                last = msg
                if msg.epoch == 149:
                    break
        assert last is not None and last.epoch == 149
        flood.close()
    _healthy(srv)


CRASHER = """
import gc, sys, threading, time
from pathlib import Path
from shardserve.server.serve import serve
from shardserve.server.settings import Settings
from shardserve.server.service import Service

ready = Path(sys.argv[2])

def break_data_plane():
    while not ready.exists():
        time.sleep(0.02)
    time.sleep(float(sys.argv[3]))
    svc = next(o for o in gc.get_objects() if isinstance(o, Service))
    svc.streamer.call(plant_bug)

def plant_bug(handler):
    # A bug in the data plane, planted from outside: its next timer tick raises.
    def tick(now):
        raise RuntimeError("planted bug")
    handler.on_tick = tick

threading.Thread(target=break_data_plane, daemon=True).start()
sys.exit(serve(Settings(store=Path(sys.argv[1]), http="127.0.0.1:0",
                        data=["tcp://127.0.0.1:0"], ready_file=ready)))
"""


def test_dead_data_plane_exits_non_zero(store: Path, tmp_path: Path) -> None:
    """If the streamer thread dies, the server says why in its log and exits 70 (a supervisor restarts it) instead of answering 200 with no data plane."""
    ready = tmp_path / "ready.json"
    proc = subprocess.run(
        [sys.executable, "-c", CRASHER, str(store), str(ready), "0.2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 70, proc.stderr[-3000:]
    assert "data plane thread died: RuntimeError: planted bug" in proc.stderr


def test_readyz_is_503_with_the_reason_once_the_data_plane_is_dead(store: Path) -> None:
    """A real Service whose streamer thread died answers /readyz (over real HTTP) 503 with the reason at once."""
    import uvicorn

    from shardserve.server.control.app import create_app
    from shardserve.server.service import Service
    from shardserve.server.settings import Settings
    from tests.support.server import free_port

    svc = Service(Settings(store=store, data=["tcp://127.0.0.1:0"], shm=False))
    svc.start()
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(svc), host="127.0.0.1", port=port, log_config=None)
    )
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + scaled(30)  # a loaded 2-core machine starts uvicorn slowly
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)  # waiting for uvicorn's readiness flag with a deadline
        assert server.started, "uvicorn did not start within 30 s"
        # Generous timeouts: uvicorn, the Service and this test share one process (and GIL)
        # on a loaded 2-core machine; what is tested is the answer, not its speed.
        assert httpx.get(f"{url}/readyz", timeout=scaled(30)).status_code == 200
        died = threading.Event()
        svc.streamer.on_death = lambda reason: died.set()

        def plant_bug(handler: object) -> None:
            def tick(now: float) -> None:
                raise RuntimeError("planted bug")

            handler.on_tick = tick  # type: ignore[attr-defined]

        svc.streamer.call(plant_bug)
        assert died.wait(scaled(30)), (
            "the streamer thread did not die of the planted bug within 30 s"
        )
        r = httpx.get(f"{url}/readyz", timeout=scaled(30))
        assert r.status_code == 503
        assert r.json()["reason"] == "data plane thread died: RuntimeError: planted bug"
        assert (
            httpx.get(f"{url}/healthz", timeout=scaled(30)).status_code == 503
        )  # liveness: restart me
    finally:
        server.should_exit = True
        t.join(scaled(10))
        svc.stop()
