"""The shard cache on its own: leases pin shards against eviction, a failed fetch publishes
nothing, and processes sharing one cache folder never see a torn or wrong file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from shardserve.server.store.cache import ShardCache, cache_key
from tests.support.slowness import scaled

from ._cache_worker import SIZE, checksum, content


def fetch_of(i: int, calls: list[int]):
    def fetch(dest: Path) -> None:
        calls.append(i)
        dest.write_bytes(content(i))

    return fetch


def test_leased_shards_survive_eviction_and_lru_order_is_kept(tmp_path: Path) -> None:
    """With room for two shards, a leased one is never evicted (the cache goes over its limit
    instead), and the least recently used unleased one goes first."""
    cache = ShardCache(tmp_path, 2 * SIZE)
    calls: list[int] = []
    a = cache.acquire(checksum(0), SIZE, fetch_of(0, calls))
    cache.acquire(checksum(1), SIZE, fetch_of(1, calls)).release()
    c = cache.acquire(checksum(2), SIZE, fetch_of(2, calls))  # 0 is leased: 1 goes
    assert cache.contains(checksum(0)) and not cache.contains(checksum(1))
    d = cache.acquire(checksum(3), SIZE, fetch_of(3, calls))  # 0 and 2 leased: over the limit
    assert all(cache.contains(checksum(i)) for i in (0, 2, 3))
    assert a.path.read_bytes() == content(0)
    for lease in (a, c, d):
        lease.release()
    cache.acquire(checksum(2), SIZE, fetch_of(2, calls)).release()  # a hit refreshes 2
    cache.acquire(checksum(4), SIZE, fetch_of(4, calls)).release()
    assert cache.contains(checksum(2)) and cache.contains(checksum(4))
    assert not cache.contains(checksum(0)) and not cache.contains(checksum(3))
    assert calls == [0, 1, 2, 3, 4]


def test_a_failed_fetch_publishes_nothing(tmp_path: Path) -> None:
    """A fetch that raises half way leaves neither a cache entry nor a temp file."""
    cache = ShardCache(tmp_path, 10 * SIZE)

    def broken(dest: Path) -> None:
        dest.write_bytes(content(0)[: SIZE // 2])
        raise OSError("connection reset by peer")

    with pytest.raises(OSError, match="connection reset"):
        cache.acquire(checksum(0), SIZE, broken)
    assert not cache.contains(checksum(0))
    assert [p.name for p in tmp_path.iterdir()] == [".locks"] or all(
        p.name.startswith(".") and not p.name.startswith(".tmp-") for p in tmp_path.iterdir()
    )


def test_processes_sharing_a_cache_never_corrupt_it(tmp_path: Path) -> None:
    """Three processes reading eight shards through one folder with room for three: every
    read checks out, every file left verifies, and no temp file remains."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.remote._cache_worker",
                str(tmp_path),
                str(3 * SIZE),
                str(seed),
                "60",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for seed in range(3)
    ]
    outs = [p.communicate(timeout=scaled(120))[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    fetched = sum(int(o.split()[-1]) for o in outs)
    assert fetched > 8  # evictions happened, so shards were fetched again
    for f in tmp_path.glob("*.arrow"):
        digest = xxhash.xxh3_64(f.read_bytes()).hexdigest()
        assert f.name == cache_key(f"xxh3_64:{digest}")
    assert not list(tmp_path.glob(".tmp-*"))
