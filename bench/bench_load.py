"""Load benchmark: many concurrent streams from one client process.

    python bench/bench_load.py [--quick] [--seconds S] [--jobs N] [--ranks R] [--workdir DIR]

Writes three cifar-like datasets (``uint8[3,32,32]`` + int64 label, ~3 KiB a sample) through
the real ``ShardWriter``, starts a real ``shardserve serve`` subprocess, creates ``jobs`` jobs
of ``ranks`` ranks over the datasets (default 8 x 4 = 32 streams, batch 64) and streams them
all at once from one thread with a ``zmq.Poller`` over raw DEALER sockets (the generator in
``bench/_support.py``, which the tests use too; consumer infinitely fast, next epoch at each EndOfEpoch).
Prints streams, total batches/s, the slowest stream's rate over the mean, and the server's
RSS idle / after warm-up / at the end; writes JSON to ``bench/results/load.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from _support import create_jobs, make_cifar_like, run_load, run_server

ROOT = Path(__file__).resolve().parents[1]


DATASETS = ("cifar_a", "cifar_b", "cifar_c")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small data, 5 s (a smoke run)")
    ap.add_argument(
        "--seconds", type=float, default=None, help="measured seconds (default 30; quick 5)"
    )
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument(
        "--samples", type=int, default=None, help="samples per dataset (default 20000; quick 2000)"
    )
    ap.add_argument("--credit", type=int, default=4)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "load.json")
    args = ap.parse_args(argv)
    seconds = args.seconds or (5.0 if args.quick else 30.0)
    samples = args.samples or (2000 if args.quick else 20_000)

    with tempfile.TemporaryDirectory(prefix="ss-bench-load-") as tmp:
        work = args.workdir or Path(tmp)
        store = work / "store"
        for i, name in enumerate(DATASETS):
            if not (store / name / "manifest.json").exists():
                make_cifar_like(store, name, n=samples, seed=i, shard_bytes=16 << 20)
        with run_server(store, "--state-dir", str(work / "state")) as srv:
            specs = [
                {
                    "dataset": DATASETS[j % len(DATASETS)],
                    "batch_size": args.batch_size,
                    "seed": j,
                    "world_size": args.ranks,
                }
                for j in range(args.jobs)
            ]
            jobs = create_jobs(srv, specs)
            res = run_load(
                srv,
                [(j, args.ranks) for j in jobs],
                seconds=seconds,
                credit=args.credit,
                warmup_s=min(3.0, seconds / 5),
            )
    summary = res.summary()
    report = {
        "bench": "load",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "config": {
            "jobs": args.jobs,
            "ranks": args.ranks,
            "datasets": len(DATASETS),
            "samples_per_dataset": samples,
            "batch_size": args.batch_size,
            "credit": args.credit,
            "seconds": seconds,
            "transport": "tcp loopback",
        },
        "result": summary,
        "errors_sample": res.errors[:5],
        "per_stream_batches_per_s": [round(r, 2) for r in res.rates],
    }
    print(f"streams            {summary['streams']}")
    print(f"total batches/s    {summary['total_batches_per_s']}  ({summary['mb_per_s']} MB/s)")
    print(
        f"per stream         min {summary['min_batches_per_s']}  mean {summary['mean_batches_per_s']}  max {summary['max_batches_per_s']}"
    )
    print(f"min/mean           {summary['min_over_mean']}")
    print(
        f"server RSS (MB)    idle {summary['rss_idle_mb']}  start {summary['rss_start_mb']}  end {summary['rss_end_mb']}"
    )
    print(f"errors             {summary['errors']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if not res.errors and min(res.rates) > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
