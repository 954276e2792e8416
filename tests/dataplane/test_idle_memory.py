"""Memory of streams that never read goes back to the OS once they close: 24 streams (socket
and shared memory) each fill their credit and stop reading; after they close, the server's
resident memory returns to within 50 MB of what it was before they opened."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shardserve.client import Loader
from tests.support.data import make_cifar_like
from tests.support.server import run_server
from tests.support.slowness import scaled

MB = 1 << 20
STREAMS = 24


def rss(pid: int) -> int:
    """Resident bytes of ``pid`` (``VmRSS`` of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.mark.parametrize("transport", ["socket", "auto"])
def test_streams_that_never_read_give_their_memory_back(tmp_path: Path, transport: str) -> None:
    """24 streams of 1.5 MB batches with credit 16 raise RSS by hundreds of MB; after they
    close it comes back within 50 MB of the start."""
    make_cifar_like(tmp_path, n=16 * 512, shard_bytes=4 << 20)
    with run_server(tmp_path) as s:
        with Loader(s.http_url, "cifar", batch_size=512, seed=0, timeout=scaled(30)) as ld:
            ld.set_epoch(0)
            next(iter(ld))  # pages of the store and the code paths warmed once
        start = rss(s.proc.pid)
        loaders, iters = [], []
        for i in range(STREAMS):
            ld = Loader(
                s.http_url,
                "cifar",
                batch_size=512,
                seed=i,
                timeout=scaled(30),
                prefetch=16,
                transport=transport,
            )
            ld.set_epoch(0)
            it = iter(ld)
            next(it)  # the stream is open; from now on it never reads
            loaders.append(ld)
            iters.append(it)
        time.sleep(1.0)  # let the server fill every stream's credit (a peak, not a condition)
        peak = rss(s.proc.pid)
        for ld in loaders:
            ld.close()
        closed = time.monotonic()
        deadline = closed + 60
        now = rss(s.proc.pid)
        while now > start + 50 * MB and time.monotonic() < deadline:
            time.sleep(0.25)
            now = rss(s.proc.pid)
        print(
            f"{transport}: RSS start {start / MB:.0f} MB, with {STREAMS} streams "
            f"{peak / MB:.0f} MB, after close {now / MB:.0f} MB "
            f"({time.monotonic() - closed:.1f} s later)"
        )
        assert peak > start + 100 * MB, "the streams did not hold memory: the test tests nothing"
        assert now <= start + 50 * MB, (start / MB, peak / MB, now / MB)
