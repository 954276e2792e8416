"""Shared helpers for reliability tests: a store, job helpers, polled waits, server RSS."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, run_server
from tests.support.server import make_job as support_make_job
from tests.support.slowness import scaled

CIFAR_N = 600


@pytest.fixture(scope="session")
def rel_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A read-only store: ``cifar`` (600 samples, several small shards) and ``other`` (200)."""
    root = tmp_path_factory.mktemp("relstore")
    make_cifar_like(root, "cifar", n=CIFAR_N, seed=0, shard_bytes=256 << 10)
    make_cifar_like(root, "other", n=200, seed=1, shard_bytes=256 << 10)
    return root


@pytest.fixture(scope="module")
def rel_server(rel_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server per module on the shared store, journal in a private state dir."""
    state = tmp_path_factory.mktemp("relstate")
    with run_server(rel_store, "--state-dir", str(state)) as srv:
        yield srv


def wait_until(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """Poll ``cond`` until it returns something truthy, or fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true within {timeout} s: {what}")
        time.sleep(every)  # polling a condition with a deadline


def make_job(srv: ServerProc, **spec: object) -> str:
    """A cifar job of batch 50 unless ``spec`` says otherwise."""
    return support_make_job(srv, **{"batch_size": 50, **spec})  # type: ignore[arg-type]


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` from /proc/<pid>/status (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def healthy(srv: ServerProc) -> bool:
    try:
        return httpx.get(f"{srv.http_url}/healthz", timeout=scaled(2)).status_code == 200
    except httpx.HTTPError:
        return False
