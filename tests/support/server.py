"""Start a real ``shardserve serve`` in a subprocess for tests, and wait until it is ready.

::

    with run_server(store) as srv:                  # ephemeral ports, ipc socket in a tmp dir
        httpx.get(f"{srv.http_url}/v1/info")
        sock.connect(srv.data_endpoints[0])         # tcp://127.0.0.1:PORT
        srv.ipc_endpoint                            # ipc:///tmp/.../ss.sock

    # restart on the same ports: pin them, kill -9, start again
    http, data = free_port(), free_port()
    with run_server(store, http_port=http, data_port=data) as srv:
        srv.kill()
    with run_server(store, http_port=http, data_port=data) as srv2: ...

Readiness is the server's ready file (written once HTTP listens and the ROUTER is bound)
followed by ``GET /readyz`` answering 200, both within ``timeout``; on failure the error
names what it waited for and carries the tail of the server's log. The harness itself is
``bench/_support.py``'s, shared with the benchmarks; here every wait is stretched by the
machine's measured slowness, so that a busy machine does not fail a test.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench._ports import free_port
from bench._support import ServerProc, make_job
from bench._support import run_server as _run_server
from tests.support.slowness import scaled, slowness

__all__ = ["ServerProc", "free_port", "job_status", "make_job", "run_server"]


@contextmanager
def run_server(
    store: Path,
    *extra_args: str,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    http_port: int = 0,
    data_port: int = 0,
    workdir: Path | None = None,
) -> Iterator[ServerProc]:
    """``bench._support.run_server`` with every wait stretched by this machine's slowness."""
    with _run_server(
        store,
        *extra_args,
        env=env,
        timeout=timeout,
        http_port=http_port,
        data_port=data_port,
        workdir=workdir,
        slowness=slowness(),
    ) as srv:
        yield srv


def job_status(srv: ServerProc, job: str) -> dict:
    """``GET /v1/jobs/{job}`` as JSON."""
    r = httpx.get(f"{srv.http_url}/v1/jobs/{job}", headers=srv.headers, timeout=scaled(10))
    assert r.status_code == 200, r.text
    return r.json()
