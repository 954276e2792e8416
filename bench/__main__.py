"""Run the benchmark suite: ``python -m bench [--quick]``.

Each ``bench/bench_*.py`` script generates its own data, measures shardserve next to its
baselines in the same run, prints a table and writes JSON under ``bench/results/``. This
runner executes them one after another (never in parallel: they would measure each other)
and prints where the JSON went. Not run by CI: timings on a shared 2-core machine are noisy,
so targets are ratios within one run, not absolute numbers in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = [
    "bench_handoff",
    "bench_cli",
    "bench_plan",
    "bench_store",
    "bench_server",
    "bench_e2e",
    "bench_load",
    "bench_remote",
    "bench_small",
    "bench_mixture",
    "bench_transforms",
    "bench_device_transforms",
    "bench_share",
    "bench_peers",
    "bench_scaling",
    "bench_epochs",
    "bench_cold",
]


def _mtimes() -> dict[Path, float]:
    return {p: p.stat().st_mtime for p in (HERE / "results").glob("*.json")}


def stamp(path: Path, run: dict[str, object]) -> None:
    """Add how, when and where a benchmark ran to the result it wrote, as its ``run`` object
    (the results page shows it): the scripts record their measurements, the runner knows the
    command. A result that has a ``run`` already keeps it."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "run" not in data:
        data["run"] = run
        path.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under ~2 minutes")
    parser.add_argument("--only", nargs="*", default=None, help=f"subset of {ORDER}")
    args = parser.parse_args(argv)
    names = [
        n for n in ORDER if (HERE / f"{n}.py").exists() and (args.only is None or n in args.only)
    ]
    failed = []
    for name in names:
        print(f"\n=== {name} {'(quick)' if args.quick else ''}", flush=True)
        t0 = time.perf_counter()
        cmd = [sys.executable, str(HERE / f"{name}.py"), *(["--quick"] if args.quick else [])]
        before, load_before = _mtimes(), os.getloadavg()
        rc = subprocess.run(cmd, cwd=HERE.parent).returncode
        run = {
            # As typed from the repository root: no interpreter or checkout path.
            "command": " ".join(["python", f"bench/{name}.py", *cmd[2:]]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
            "load_before": list(load_before),
            "load_after": list(os.getloadavg()),
        }
        for path, mtime in _mtimes().items():
            if not rc and before.get(path) != mtime:
                stamp(path, run)
        print(f"--- {name}: exit {rc} in {time.perf_counter() - t0:.1f} s", flush=True)
        if rc:
            failed.append(name)
    print(f"\nresults: {HERE / 'results'}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
