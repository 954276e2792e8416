"""A dataset version replaced or deleted on disk is unmapped once no job pins it, whether or
not anything opened the name since; the current version stays mapped (the store's cache). By
what the server counts: ``shardserve_store_mapped_versions``."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import httpx

from shardserve.proto.messages import Bye, Welcome
from tests.server.rawclient import Batch, RawStream, zmq_context
from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, make_job, run_server
from tests.support.slowness import scaled


def mapped(srv: ServerProc) -> float:
    text = httpx.get(f"{srv.http_url}/metrics", headers=srv.headers, timeout=scaled(10)).text
    m = re.search(r"^shardserve_store_mapped_versions (\S+)$", text, re.MULTILINE)
    assert m is not None, "no shardserve_store_mapped_versions in /metrics"
    return float(m.group(1))


def read_one_batch(srv: ServerProc, job: str) -> None:
    """Open a stream of ``job`` (which maps its dataset version) and read one batch."""
    with zmq_context() as ctx:
        peer = RawStream(ctx, srv.tcp_endpoint)
        peer.hello(job, credit=1)
        peer.recv_kind(Welcome, timeout=scaled(20))
        peer.recv_kind(Batch, timeout=scaled(20))
        peer.send(Bye())
        peer.close()


def delete(srv: ServerProc, job: str) -> None:
    r = httpx.delete(f"{srv.http_url}/v1/jobs/{job}", headers=srv.headers, timeout=scaled(10))
    assert r.status_code == 200, r.text


def wait_mapped(srv: ServerProc, want: float) -> None:
    deadline = time.monotonic() + scaled(10)
    while (got := mapped(srv)) != want:
        assert time.monotonic() < deadline, f"{got} versions mapped, expected {want}"
        time.sleep(0.05)


def test_a_version_no_job_pins_is_unmapped_unless_current(tmp_path: Path) -> None:
    make_cifar_like(tmp_path, "cifar", n=256, seed=0)
    make_cifar_like(tmp_path, "gone", n=256, seed=2)
    with run_server(tmp_path) as srv:
        old = make_job(srv, batch_size=16, seed=1)
        read_one_batch(srv, old)
        assert mapped(srv) == 1
        shutil.rmtree(tmp_path / "cifar")
        make_cifar_like(tmp_path, "cifar", n=300, seed=1)  # another version, nothing opens it
        delete(srv, old)  # its last job: the replaced version goes
        wait_mapped(srv, 0)
        new = make_job(srv, batch_size=16, seed=1)
        read_one_batch(srv, new)
        delete(srv, new)  # the current version stays mapped for the next job
        assert mapped(srv) == 1
        doomed = make_job(srv, dataset="gone", batch_size=16, seed=1)
        read_one_batch(srv, doomed)
        wait_mapped(srv, 2)
        shutil.rmtree(tmp_path / "gone")  # deleted on disk while its job lives
        delete(srv, doomed)
        wait_mapped(srv, 1)
