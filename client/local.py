"""``serve_local``: a shardserve server as a child process, for notebooks and scripts.

The server runs in a fresh interpreter started with ``subprocess.Popen`` (never a fork of
the caller's, which may hold CUDA contexts or threads), is awaited on its ready file and
``GET /readyz``, and is stopped on exit of the block and at interpreter exit.
"""

from __future__ import annotations

import atexit
import functools
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from shardserve.proto.errors import ServerUnavailable

_STOP_GRACE_S = 5.0


def _tail(path: Path, nbytes: int = 3000) -> str:
    try:
        return path.read_bytes()[-nbytes:].decode(errors="replace")
    except OSError:
        return "<no log>"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=_STOP_GRACE_S)


def _wait_ready(proc: subprocess.Popen[bytes], ready_file: Path, log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    waited_for, url, delay = f"ready file {ready_file}", "", 0.01
    while time.monotonic() < deadline and proc.poll() is None:
        if not url and ready_file.exists():
            try:
                url = str(json.loads(ready_file.read_text())["http"])
                waited_for = f"GET {url}/readyz == 200"
            except (ValueError, KeyError):
                pass  # written but not complete yet
        if url:
            try:
                if httpx.get(f"{url}/readyz", timeout=1.0, trust_env=False).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(delay)  # polling a readiness condition under a deadline
        delay = min(2 * delay, 0.1)
    if proc.poll() is not None:
        raise ServerUnavailable(
            f"shardserve server (pid {proc.pid}) exited with code {proc.returncode} before it "
            f"was ready (waiting for {waited_for}); its output ends with:\n{_tail(log)}"
        )
    raise ServerUnavailable(
        f"shardserve server (pid {proc.pid}) not ready within {timeout} s: waited for {waited_for}; "
        f"process still running; its output ends with:\n{_tail(log)}"
    )


@contextmanager
def serve_local(store: str | Path, *args: str, timeout: float = 30.0) -> Iterator[str]:
    """Run ``shardserve serve --store STORE`` on loopback for the duration of the block.

    Yields the HTTP URL; ``args`` are extra ``serve`` options (e.g. ``"--token", "s3cret"``).

    ```python
    with serve_local("/data/store") as url:
        for batch in Loader(url, dataset="digits", batch_size=64):
            ...
    ```
    """
    tmp = tempfile.TemporaryDirectory(prefix="ss-local-")
    work = Path(tmp.name)
    log = work / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "shardserve.server",
        "serve",
        "--store",
        str(store),
        "--http",
        "127.0.0.1:0",
        "--data",
        "tcp://127.0.0.1:0",
        "--ipc",
        str(work / "ss.sock"),
        "--ready-file",
        str(work / "ready.json"),
        *args,
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    # A kernel shutdown or a script that never leaves the block still stops the server.
    stop = functools.partial(_stop, proc)
    atexit.register(stop)
    try:
        yield _wait_ready(proc, work / "ready.json", log, timeout)
    finally:
        stop()
        atexit.unregister(stop)
        tmp.cleanup()
