"""Start a real ``shardserve serve`` in a subprocess for tests, and wait until it is ready.

::

    with run_server(store) as srv:                  # ephemeral ports, ipc socket in a tmp dir
        httpx.get(f"{srv.http_url}/v1/info")
        sock.connect(srv.data_endpoints[0])         # tcp://127.0.0.1:PORT
        srv.ipc_endpoint                            # ipc:///tmp/.../ss.sock

    # restart on the same ports (issue 5): pin them, kill -9, start again
    http, data = free_port(), free_port()
    with run_server(store, http_port=http, data_port=data) as srv:
        srv.kill()
    with run_server(store, http_port=http, data_port=data) as srv2: ...

Readiness is the server's ready file (written once HTTP listens and the ROUTER is bound)
followed by ``GET /readyz`` answering 200, both within ``timeout``; on failure the error
names what it waited for and carries the tail of the server's log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.slowness import scaled

_TERM_GRACE_S = 5.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        self.proc.wait(timeout=scaled(_TERM_GRACE_S))

    def terminate(self, timeout: float | None = None) -> int:
        """SIGTERM the server and return its exit code; SIGKILL if it outlives ``timeout``
        (default 5 s times the machine's measured slowness)."""
        timeout = scaled(_TERM_GRACE_S) if timeout is None else timeout
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=scaled(_TERM_GRACE_S))
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
    srv_dir: Path, proc: subprocess.Popen[bytes], log: Path, token: str | None, timeout: float
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
                r = httpx.get(f"{info['http']}/readyz", headers=headers, timeout=scaled(1.0))
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
) -> Iterator[ServerProc]:
    """Run ``shardserve serve`` on ``store`` until the block exits.

    ``http_port``/``data_port`` 0 pick ephemeral ports; pass :func:`free_port` values to
    start a second server on the same ports after the first died. ``workdir`` holds the ready
    file, the log and the ipc socket (a fresh temporary folder by default; pass the same one
    to keep the ipc path across a restart). ``env`` is added to the current environment.
    ``timeout`` (default 20 s times the machine's measured slowness) bounds the wait for
    readiness. The store folder is created if missing (``--create``). On exit the server gets
    SIGTERM (then SIGKILL after 5 s, stretched like ``timeout``) and must be gone.
    """
    timeout = scaled(20.0) if timeout is None else timeout
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
    srv = ServerProc("", [], proc, log_path, token)
    try:
        info = _wait_ready(workdir, proc, log_path, token, timeout)
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
    r = httpx.post(f"{srv.http_url}/v1/jobs", json=body, headers=srv.headers, timeout=scaled(10))
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


def job_status(srv: ServerProc, job: str) -> dict:
    """``GET /v1/jobs/{job}`` as JSON."""
    r = httpx.get(f"{srv.http_url}/v1/jobs/{job}", headers=srv.headers, timeout=scaled(10))
    assert r.status_code == 200, r.text
    return r.json()
