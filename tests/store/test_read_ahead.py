"""A local shard is read whole, ahead of the rows asked for, when a real server first reads it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from shardserve.client import Loader
from shardserve.server.store.read.read_ahead import MAX_SHARDS, ReadAhead
from shardserve.server.store.write.writer import ShardWriter
from tests.support.data import CIFAR_FIELDS, cifar_images
from tests.support.server import run_server
from tests.support.slowness import scaled

N = 12_000  # about 37 MB: 3 shards of 16 MiB
SHARD_BYTES = 16 << 20

pytestmark = pytest.mark.skipif(shutil.which("fincore") is None, reason="fincore is not on PATH")


def _resident(path: Path) -> float:
    """The share of ``path``'s bytes in the page cache (util-linux ``fincore``)."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", str(path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=scaled(10),
    ).stdout.split()
    return int(out[0]) / max(int(out[1]), 1)


def _evict(path: Path) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _store(root: Path) -> Path:
    with ShardWriter(root, "cifar", fields=CIFAR_FIELDS, shard_bytes=SHARD_BYTES) as w:
        for start in range(0, N, 2000):
            stop = min(N, start + 2000)
            w.add_batch(
                {"image": cifar_images(start, stop, 0), "label": np.arange(start, stop) % 10}
            )
    return sorted((root / "cifar").rglob("*.arrow"))[0]


def _first_batch_then_resident(store: Path, first: Path, want: float, *args: str) -> float:
    with run_server(store, *args) as srv:
        _evict(first)
        assert _resident(first) < 0.05  # the page cache let it go (a real disk, not tmpfs)
        with Loader(srv.http_url, "cifar", 64, seed=0, shuffle=False) as loader:
            next(iter(loader))
            deadline = time.monotonic() + scaled(15.0)
            while (got := _resident(first)) < want and time.monotonic() < deadline:
                time.sleep(0.05)  # polling the page cache with a deadline, not a fixed wait
    return got


def test_first_read_of_a_shard_reads_it_whole(tmp_path: Path) -> None:
    """One batch from the first shard brings the whole 16 MiB shard into the page cache."""
    first = _store(tmp_path / "store")
    assert _first_batch_then_resident(tmp_path / "store", first, 1.0) >= 1.0


def test_read_ahead_bytes_bounds_what_is_asked(tmp_path: Path) -> None:
    """With --read-ahead-bytes 4MiB the kernel is asked for 4 MiB of the shard, not all of it."""
    first = _store(tmp_path / "store")
    args = ("--read-ahead-bytes", "4MiB")
    got = _first_batch_then_resident(tmp_path / "store", first, 0.25, *args)
    assert 0.25 <= got < 0.9


def test_spread_reads_ask_nothing_and_shards_are_asked_once(tmp_path: Path) -> None:
    """A read over more than MAX_SHARDS shards asks for none; a shard is asked again only after again_s."""
    files = []
    for i in range(MAX_SHARDS + 1):
        path = tmp_path / f"s{i}"
        path.write_bytes(b"x" * 8192)
        files.append(os.open(path, os.O_RDONLY))
    now = [0.0]
    ra = ReadAhead(
        [(fd, 8192) for fd in files], limit_bytes=1 << 20, again_s=30.0, clock=lambda: now[0]
    )
    try:
        ra.touch(range(MAX_SHARDS + 1))  # a global shuffle's batch
        assert ra.asked == 0
        ra.touch(range(MAX_SHARDS))
        ra.touch([0, 1])
        assert ra.asked == MAX_SHARDS
        now[0] = 31.0
        ra.touch([0])
        assert ra.asked == MAX_SHARDS + 1
    finally:
        ra.close()
        for fd in files:
            os.close(fd)
