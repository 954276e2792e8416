"""An idle server stays small: pyarrow and numpy.random load with the first job, not before."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from shardserve.client import Loader
from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

#: Libraries an idle server does not map: pyarrow's and numpy.random's compiled modules.
LAZY = ("libarrow", "/numpy/random/")


def _lazy_mapped(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    return {lib for lib in LAZY if lib in maps}


def _server_pids(srv: ServerProc, want: int) -> list[int]:
    """The main process's pid, then its ``want`` streaming processes' once all are up."""
    deadline = time.monotonic() + scaled(30)
    while True:
        r = httpx.get(f"{srv.http_url}/v1/processes", headers=srv.headers, timeout=scaled(10))
        assert r.status_code == 200, r.text
        up = [int(p["pid"]) for p in r.json() if p["up"]]
        if len(up) == want:
            return [srv.proc.pid, *up]
        assert time.monotonic() < deadline, f"waited for {want} streaming processes: {r.json()}"
        time.sleep(0.05)  # polling the process list with a deadline


def test_idle_server_and_its_streaming_processes_map_no_arrow_until_a_job_reads(
    tmp_path: Path,
) -> None:
    """A server with two streaming processes, asked for its datasets and processes, maps
    neither Arrow nor numpy.random in any process until a job reads a batch."""
    make_cifar_like(tmp_path, "cifar", n=64)
    with run_server(tmp_path, "--stream-processes", "2") as srv:
        pids = _server_pids(srv, 2)
        r = httpx.get(f"{srv.http_url}/v1/datasets", headers=srv.headers, timeout=scaled(10))
        assert r.status_code == 200 and r.json()[0]["name"] == "cifar", r.text
        assert {p: _lazy_mapped(p) for p in pids} == {p: set() for p in pids}
        with Loader(srv.http_url, "cifar", 16, timeout=scaled(60)) as ld:
            assert len(next(iter(ld))["label"]) == 16
        # The same check sees both once a job has read: they load at first use.
        assert set().union(*(_lazy_mapped(p) for p in pids)) == set(LAZY)
