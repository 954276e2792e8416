"""Planning an epoch: time and peak memory for 40 million samples, world size 8.

``python bench/bench_plan.py [--quick] [--n N] [--repeats R]``

Every measurement runs in a fresh interpreter, so its peak RSS (``ru_maxrss``) minus
the RSS after imports is what planning itself cost. Cases:

- ``global`` / ``block``: ``epoch_order`` for the epoch (block: 64 MiB shards of
  3 KiB samples, i.e. 21,845 rows, window 4), then ``RankPlan.from_order`` for rank 0
  of 8 and every one of its batches of 256 (``int64`` ids, as the assembler gets them);
- ``mixture``: ``mixture_order`` of ``n`` positions from three sources of 37.5 / 32.5 /
  37.5 % of ``n`` samples, weights 0.5 / 0.3 / 0.2 changed to 0.2 / 0.3 / 0.5 half way (a
  schedule): each source is drawn ~35 / 30 / 35 % of ``n`` times, so none wraps (a wrap costs
  one more permutation of that source); then rank 0's batches as for ``global``; compared with
  ``global`` in the same run;
- ``naive``: ``rng.shuffle(np.arange(n, dtype=np.uint32))``, the obvious global
  shuffle, for scale (``numpy.random.Generator.shuffle`` misses cache on every swap).

Target: 40M samples plan in <= 2 s and <= 400 MB. Prints a table and
writes ``bench/results/plan.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "plan.json"
TARGET_S = 2.0
TARGET_MB = 400.0
WORLD_SIZE = 8
BATCH_SIZE = 256
SHARD_ROWS = (64 << 20) // 3072  # a 64 MiB shard of 3 KiB (CIFAR-like) samples
CASES = ["global", "block", "mixture", "naive"]


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(case: str, n: int) -> dict[str, float]:
    """Run one case in this (fresh) process; return its figures."""
    import numpy as np

    from shardserve.server.planning import RankPlan, epoch_order

    full, rest = divmod(n, SHARD_ROWS)
    shard_rows = np.array([SHARD_ROWS] * full + ([rest] if rest else []), dtype=np.int64)
    base = peak_mb()
    t0 = time.perf_counter()
    if case == "naive":
        order = np.arange(n, dtype=np.uint32)
        np.random.default_rng(np.random.SeedSequence([0, 1])).shuffle(order)
    elif case == "mixture":
        from shardserve.server.planning.mixture import MixSource, Segment, mixture_order

        sizes = [n * 3 // 8, n * 13 // 40, n * 3 // 8]
        order = mixture_order(
            [MixSource(k) for k in sizes],
            seed=0,
            epoch=1,
            length=n,
            world_size=WORLD_SIZE,
            segments=[Segment(0, (0.5, 0.3, 0.2)), Segment(n // 2, (0.2, 0.3, 0.5))],
        )
    else:
        order = epoch_order(n, seed=0, epoch=1, shuffle=case, shard_rows=shard_rows)  # type: ignore[arg-type]
    plan_s = time.perf_counter() - t0
    plan_mb = peak_mb() - base
    t0 = time.perf_counter()
    rank = RankPlan.from_order(order, WORLD_SIZE, 0, BATCH_SIZE, drop_last=False)
    ids = sum(len(b) for b in rank)
    batches_s = time.perf_counter() - t0
    return {
        "plan_s": plan_s,
        "plan_peak_mb": plan_mb,
        "rank_batches_s": batches_s,
        "rank_batches": len(rank),
        "rank_ids": ids,
        "total_peak_mb": peak_mb() - base,
    }


def run_case(case: str, n: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", case, "--n", str(n)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat instead of three")
    parser.add_argument("--n", type=int, default=40_000_000, help="samples in the epoch")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        json.dump(child(args.child, args.n), sys.stdout)
        return 0
    repeats = args.repeats or (1 if args.quick else 3)
    rows = {}
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    for case in CASES:
        runs = [run_case(case, args.n) for _ in range(repeats)]
        rows[case] = {
            "plan_s": statistics.median(r["plan_s"] for r in runs),
            "plan_peak_mb": max(r["plan_peak_mb"] for r in runs),
            "rank_batches_s": statistics.median(r["rank_batches_s"] for r in runs),
            "rank_batches": runs[0]["rank_batches"],
            "runs": runs,
        }
    print(
        f"plan one epoch: n={args.n:,}, world_size={WORLD_SIZE}, batch_size={BATCH_SIZE}, "
        f"median of {repeats} fresh processes; peak = max RSS delta"
    )
    print(f"{'case':<8} {'plan s':>8} {'peak MB':>8} {'rank-0 batches':>15} {'s':>7}  target")
    for case, r in rows.items():
        met = r["plan_s"] <= TARGET_S and r["plan_peak_mb"] <= TARGET_MB
        verdict = "(baseline)" if case == "naive" else ("met" if met else "MISSED")
        print(
            f"{case:<8} {r['plan_s']:>8.2f} {r['plan_peak_mb']:>8.0f} {r['rank_batches']:>15,} "
            f"{r['rank_batches_s']:>7.3f}  {verdict}"
        )
    speedup = rows["naive"]["plan_s"] / rows["global"]["plan_s"]
    print(f"global vs naive rng.shuffle: {speedup:.2f}x faster")
    mix_ratio = rows["mixture"]["plan_s"] / rows["global"]["plan_s"]
    print(f"mixture vs global (same n): {mix_ratio:.2f}x the time; load average {load}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "plan",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "n_samples": args.n,
        "world_size": WORLD_SIZE,
        "batch_size": BATCH_SIZE,
        "block_shard_rows": SHARD_ROWS,
        "repeats": repeats,
        "target": {"plan_s": TARGET_S, "plan_peak_mb": TARGET_MB},
        "cases": rows,
        "global_vs_naive_speedup": speedup,
        "mixture_vs_global_time": mix_ratio,
        "load_average": load,
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
