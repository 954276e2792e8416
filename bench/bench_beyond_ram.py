"""A block-shuffled epoch read from disk, against the disk's sequential rate (``dd``).

``python bench/bench_beyond_ram.py [--gb 6] [--workdir DIR] [--ranks 1]``

CIFAR-like samples (``uint8[3,32,32]`` + label, about 3 KiB each) in 256 MiB shards, ``--gb``
of them (the store of ``bench_cold.py``, reused when present). Before each row every shard
file is dropped from the page cache (``posix_fadvise DONTNEED``: clean pages go, no root
needed), so each row reads the whole dataset from the disk, as an epoch over a dataset
larger than RAM does. Rows, in one run:

* ``dd``: ``dd bs=16M`` of every shard file, one after another (the ceiling);
* ``epoch, read-ahead off``: a new server with ``--read-ahead-bytes 0``, one job of
  ``--ranks`` ranks, ``shuffle="block"`` (windows of 4 shards), batch 256, one epoch: the
  dataset's bytes over the seconds from the Loaders' start to the last batch;
* ``epoch, read-ahead on``: the same with the default (a shard's first read asks the kernel
  for the whole file);
* ``epoch, all cached``: the same with the whole dataset in the page cache (the server's and
  the Loaders' own ceiling on this machine: no disk read can beat it).

Target: read-ahead on >= 0.9x ``dd``. Not run by CI (it writes GBs). Writes
``bench/results/beyond_ram.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _support import run_server
from bench_cold import cached_fraction, evict, make_store

from shardserve.client import Loader

HERE = Path(__file__).resolve().parent

RESULTS = HERE / "results" / "beyond_ram.json"
SAMPLE_BYTES = 3 * 32 * 32 + 8 + 2  # the image, the label and Arrow's share, about
BATCH = 256
TARGET = 0.9
NAME = "blocks"


def dd_rate(folder: Path) -> tuple[float, int]:
    """Bytes/s of ``dd`` reading every shard file of ``folder`` in turn, from the disk."""
    files = sorted(folder.rglob("*.arrow"))
    total = sum(f.stat().st_size for f in files)
    evict(folder)
    t0 = time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    return total / (time.perf_counter() - t0), total


def _rank(url: str, rank: int, world: int, start: mp.Barrier, out: mp.Queue) -> None:
    with Loader(url, NAME, BATCH, seed=0, shuffle="block", rank=rank, world_size=world) as ld:
        start.wait(timeout=120)
        n = sum(len(b["label"]) for b in ld)
    out.put(n)


def epoch_rate(
    store: Path, world: int, read_ahead: str | None, cold: bool = True
) -> dict[str, float]:
    """One block-shuffled epoch of ``world`` ranks from a new server, the page cache empty
    (``cold``) or holding the whole dataset (read once first)."""
    folder = store / NAME
    total = sum(f.stat().st_size for f in folder.rglob("*.arrow"))
    if cold:
        evict(folder)
    else:
        for f in folder.rglob("*.arrow"):
            subprocess.run(
                ["dd", f"if={f}", "of=/dev/null", "bs=16M"], check=True, capture_output=True
            )
    args = () if read_ahead is None else ("--read-ahead-bytes", read_ahead)
    ctx = mp.get_context("spawn")
    with run_server(store, *args) as srv:
        start, out = ctx.Barrier(world + 1), ctx.Queue()
        procs = [
            ctx.Process(target=_rank, args=(srv.http_url, r, world, start, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        start.wait(timeout=120)
        t0 = time.perf_counter()
        samples = sum(out.get(timeout=1800) for _ in procs)
        took = time.perf_counter() - t0
        for p in procs:
            p.join(timeout=60)
    return {
        "samples": samples,
        "seconds": round(took, 2),
        "bytes_per_s": total / took,
        "cached_after": cached_fraction(folder) or 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=6.0, help="dataset size in GB (10**9 bytes)")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    p.add_argument("--workdir", type=Path, default=HERE / "data")
    args = p.parse_args(argv)
    n = int(args.gb * 1e9 / SAMPLE_BYTES)
    t0 = time.perf_counter()
    store = make_store(args.workdir, n)
    print(f"store {store} ({n:,} samples) ready in {time.perf_counter() - t0:.0f} s")
    load = os.getloadavg()
    total = sum(f.stat().st_size for f in (store / NAME).rglob("*.arrow"))
    # Rounds interleave the rows: a shared disk's rate drifts, and a row measured in another
    # minute than its baseline would compare the drift.
    runs = (
        ("epoch, read-ahead off", "0", True),
        ("epoch, read-ahead on", None, True),
        ("epoch, all cached", None, False),
    )
    trials: dict[str, list[float]] = {"dd": [], **{label: [] for label, _, _ in runs}}
    for i in range(args.rounds):
        trials["dd"].append(dd_rate(store / NAME)[0])
        for label, ra, cold in runs:
            trials[label].append(epoch_rate(store, args.ranks, ra, cold)["bytes_per_s"])
        print(
            f"round {i}: "
            + ", ".join(f"{k} {v[-1] / 1e9:.2f}" for k, v in trials.items())
            + f" GB/s; load {os.getloadavg()[0]:.2f}"
        )
    dd = statistics.median(trials["dd"])
    print(f"dd sequential          {dd / 1e9:6.2f} GB/s ({total / 1e9:.1f} GB), median")
    rows: dict[str, dict[str, object]] = {"dd": {"bytes_per_s": dd, "trials": trials["dd"]}}
    for label, _, _ in runs:
        rate = statistics.median(trials[label])
        ratios = [t / d for t, d in zip(trials[label], trials["dd"], strict=True)]
        rows[label] = {
            "bytes_per_s": rate,
            "ratio_to_dd": statistics.median(ratios),
            "trials": trials[label],
            "ratios": ratios,
        }
        print(
            f"{label:22} {rate / 1e9:6.2f} GB/s  {statistics.median(ratios):.2f}x dd (median "
            f"of the rounds' ratios {', '.join(f'{r:.2f}' for r in ratios)})"
        )
    on = float(statistics.median(rows["epoch, read-ahead on"]["ratios"]))  # type: ignore[arg-type]
    print(
        f"target read-ahead on >= {TARGET}x dd: {'met' if on >= TARGET else 'NOT met'}; "
        f"load {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    res = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.machine()} cpus={os.cpu_count()}",
        "bytes": total,
        "ranks": args.ranks,
        "batch": BATCH,
        "load_before": load,
        "load_after": os.getloadavg(),
        "rows": rows,
        "target": TARGET,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
