"""The first batch from a new server when the dataset is not in the page cache.

``python bench/bench_cold.py [--quick] [--n N] [--workdir DIR]``

CIFAR-like samples (``uint8[3,32,32]`` + label, ``n`` = 1,000,000: 3.1 GB; ``--quick``
300,000) in 256 MiB shards, global shuffle, batch 256, one Loader over shared memory. Before
each measurement the shard files are dropped from the page cache (``posix_fadvise
DONTNEED``; they are clean, so the kernel lets them go), so every byte the first batch needs
comes from the disk, as on a dataset larger than RAM. Measured: seconds from a new server's
readiness through ``Loader(...)`` to its first batch.

Two manifests over the same shard files (hard links), in one run:

* ``blocks``: what ingest writes now, a checksum per 1 MiB block of each shard: the first
  batch verifies the blocks it reads (and each shard's framing and footer);
* ``whole-file`` (the baseline): the same shards listed without block checksums, as written
  before: each shard's whole file is checksummed before its first read, so a global first
  batch reads the whole dataset.

Target: on a dataset larger than RAM, the first batch <= 2 s. Writes
``bench/results/cold.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _support import CIFAR_FIELDS as CIFAR
from _support import run_server

from shardserve.client import Loader
from shardserve.server.store.write.writer import ShardWriter

HERE = Path(__file__).resolve().parent

RESULTS = HERE / "results" / "cold.json"
TARGET_S = 2.0
BATCH = 256
PIECE = 100_000


def make_store(root: Path, n: int) -> Path:
    """``blocks`` (as ingest writes it) and ``whole-file`` (its shards without block sums)."""
    store = root / f"cold-{n}"
    if (store / "whole-file" / "manifest.json").exists():
        return store
    rng = np.random.default_rng(0)
    with ShardWriter(store, "blocks", fields=CIFAR) as w:
        for s in range(0, n, PIECE):
            k = min(n, s + PIECE) - s
            w.add_batch(
                {
                    "image": rng.integers(0, 256, (k, 3, 32, 32), dtype=np.uint8),
                    "label": np.arange(s, s + k) % 10,
                }
            )
    doc = json.loads((store / "blocks" / "manifest.json").read_text())
    doc["name"] = "whole-file"
    for shard in doc["shards"]:
        del shard["block_bytes"], shard["blocks"]
    (store / "whole-file" / "shards").mkdir(parents=True)
    for shard in doc["shards"]:
        os.link(store / "blocks" / shard["path"], store / "whole-file" / shard["path"])
    (store / "whole-file" / "manifest.json").write_text(json.dumps(doc))
    return store


def evict(folder: Path) -> None:
    """Drop ``folder``'s shard files from the page cache."""
    for path in folder.rglob("*.arrow"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(folder: Path) -> float | None:
    """The share of ``folder``'s shard bytes in the page cache (util-linux ``fincore``;
    ``None`` where it is missing)."""
    files = sorted(str(p) for p in folder.rglob("*.arrow"))
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *files],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    held = total = 0
    for line in out.splitlines():
        res, size = line.split()
        held, total = held + int(res), total + int(size)
    return held / max(total, 1)


def first_batch(store: Path, name: str) -> tuple[float, float | None]:
    """Seconds to the first batch of ``name`` from a new server; the share of the dataset in
    the page cache afterwards (what the first batch read)."""
    evict(store / name)
    with run_server(store) as srv:
        t0 = time.perf_counter()
        with Loader(srv.http_url, name, BATCH, seed=0, shuffle=True) as loader:
            next(iter(loader))
            took = time.perf_counter() - t0
    return took, cached_fraction(store / name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="300,000 samples")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--workdir", type=Path, default=None, help="keep the data here")
    args = p.parse_args(argv)
    n = args.n or (300_000 if args.quick else 1_000_000)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ss-cold-") as tmp:
        store = make_store(args.workdir or Path(tmp), n)
        gb = sum(f.stat().st_size for f in (store / "blocks").rglob("*.arrow")) / 1e9
        whole_s, whole_read = first_batch(store, "whole-file")
        blocks_s, blocks_read = first_batch(store, "blocks")
    load_after = os.getloadavg()
    met = blocks_s <= TARGET_S
    print(
        f"first batch from a new server, {n:,} CIFAR-like samples ({gb:.2f} GB) off the page cache"
    )
    for label, took, read in (
        ("whole-file checksums (before)", whole_s, whole_read),
        ("block checksums (now)", blocks_s, blocks_read),
    ):
        share = "" if read is None else f", {read:.0%} of the dataset read"
        print(f"  {label:30} {took:6.2f} s{share}")
    print(
        f"  {whole_s / blocks_s:.1f}x sooner; target <= {TARGET_S:.0f} s: {'met' if met else 'MISSED'}"
    )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "cold",
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                "quick": args.quick,
                "n_samples": n,
                "dataset_gb": gb,
                "batch_size": BATCH,
                "first_batch_s": {"whole_file": whole_s, "blocks": blocks_s},
                "read_share": {"whole_file": whole_read, "blocks": blocks_read},
                "speedup": whole_s / blocks_s,
                "target": {"first_batch_s": TARGET_S, "met": met},
                "load_before": load_before,
                "load_after": load_after,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
