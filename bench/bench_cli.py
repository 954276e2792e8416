"""How long the ``shardserve`` command takes to answer ``--help``: the first thing a user runs.

Median of N fresh interpreters (default 10) for each command, against ``python -c pass`` (the
interpreter's own start) in the same run; the targets are ``shardserve --help``,
``shardserve serve --help`` and ``shardserve ingest --help`` (the first command of the
README) within 0.5 s. Runs the installed console script when there is one
next to this python (what a user types), else ``python -m shardserve.server``. Prints a table
with the load average and writes ``bench/results/cli.json``.

    python bench/bench_cli.py [--runs 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "cli.json"
TARGET_S = 0.5


def _median_s(argv: list[str], runs: int) -> tuple[float, float, float]:
    took = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        took.append(time.perf_counter() - t0)
    return statistics.median(took), min(took), max(took)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10, help="fresh processes per command")
    p.add_argument("--quick", action="store_true", help="5 runs")
    args = p.parse_args(argv)
    runs = 5 if args.quick else args.runs
    script = Path(sys.executable).parent / "shardserve"
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "shardserve.server"]
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "shardserve --help": [*cli, "--help"],
        "shardserve serve --help": [*cli, "serve", "--help"],
        "shardserve ingest --help": [*cli, "ingest", "--help"],
        "shardserve --version": [*cli, "--version"],
    }
    load_before = os.getloadavg()
    rows = {}
    for label, cmd in cases.items():
        med, lo, hi = _median_s(cmd, runs)
        rows[label] = {"median_s": med, "min_s": lo, "max_s": hi}
    base = rows["python -c pass"]["median_s"]
    for r in rows.values():
        r["vs_python"] = r["median_s"] / base
    targets = [
        {
            "target": f"{label} median <= {TARGET_S} s",
            "value": rows[label]["median_s"],
            "met": rows[label]["median_s"] <= TARGET_S,
        }
        for label in ("shardserve --help", "shardserve serve --help", "shardserve ingest --help")
    ]
    result = {
        "runs": runs,
        "command": " ".join(cli),
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "rows": rows,
        "targets": targets,
    }
    print(
        f"{runs} runs each; load average {load_before[0]:.2f} before, "
        f"{result['load_average_after'][0]:.2f} after; command {' '.join(cli)}"
    )
    print(f"  {'command':28}{'median s':>10}{'min':>8}{'max':>8}{'x python':>10}")
    for label, r in rows.items():
        print(
            f"  {label:28}{r['median_s']:>10.3f}{r['min_s']:>8.3f}{r['max_s']:>8.3f}"
            f"{r['vs_python']:>10.1f}"
        )
    for t in targets:
        print(f"  target {t['target']}: {t['value']:.3f} {'met' if t['met'] else 'MISSED'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
