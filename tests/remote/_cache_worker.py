"""A process hammering a shared ShardCache (run by test_cache.py): prints how many it fetched.

Usage: python -m tests.remote._cache_worker CACHE_DIR LIMIT SEED ROUNDS
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import xxhash

from shardserve.server.store.cache import ShardCache

SHARDS = 8
SIZE = 96 << 10


def content(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


def checksum(i: int) -> str:
    return f"xxh3_64:{xxhash.xxh3_64(content(i)).hexdigest()}"


def main() -> None:
    cache_dir, limit, seed, rounds = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
    cache = ShardCache(Path(cache_dir), limit)
    fetched = 0

    def fetch_of(i: int):
        def fetch(dest: Path) -> None:
            nonlocal fetched
            fetched += 1
            data = content(i)
            with open(dest, "wb") as f:
                for k in range(0, len(data), 16 << 10):  # slowly: widen every race window
                    f.write(data[k : k + (16 << 10)])
                    f.flush()
                    time.sleep(0.001)

        return fetch

    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        i = int(rng.integers(0, SHARDS))
        lease = cache.acquire(checksum(i), SIZE, fetch_of(i))
        try:
            got = lease.path.read_bytes()
        finally:
            lease.release()
        if xxhash.xxh3_64(got).hexdigest() != checksum(i).split(":")[1]:
            print(f"CORRUPT shard {i} at {lease.path}", flush=True)
            sys.exit(1)
    print(f"fetched {fetched}", flush=True)


if __name__ == "__main__":
    main()
