"""Private memory of an idle server, main process and streaming processes, with no neighbour.

    python bench/bench_idle.py [--starts 3] [--processes 1,2] [--baseline DIR]

Starts ``shardserve serve`` on an empty store ``--starts`` times per ``--stream-processes``
count, waits for readiness and 3 s more, and reads ``/proc/PID/smaps_rollup`` of the main
process and of each streaming process: private memory (``Private_Clean + Private_Dirty``,
what the kernel frees when the process exits) and its anonymous part.

A library page counts as private only while no other process maps the same file, so the
server is started by a ``python -c`` that imports nothing of shardserve (``bench_memory``'s
server shares pyarrow's code with the bench, which wrote the dataset, and looks ~25 MiB
smaller than a sidecar beside a trainer that never imports pyarrow). With streaming
processes the library pages are shared among the server's own processes.

``--baseline DIR``: a folder holding ``shardserve/{server,client,proto}`` of another
checkout (links to its folders); the same starts run on that code first (``PYTHONPATH``),
the "before" in the same run. This checkout's code is then loaded the same way, through a
folder of links, not through the editable install's import finder, which leaves ~0.6 MiB
more on the heap of a server that does not trim it. Each code's bytecode is compiled
first (``compileall``), as an installed package's is: a server that compiles its modules
as it imports them (no ``__pycache__``, or ``PYTHONDONTWRITEBYTECODE=1``) holds ~0.8 MiB
more anonymous memory, what ``compile()`` left behind. Target: <= 60 MiB private, each
process. Writes ``bench/results/idle.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from _proc import smaps_rollup_kib

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "idle.json"
TARGET_MIB = 60.0
SETTLE_S = 3.0

#: Starts the server as a child of a process that has imported none of its libraries.
LAUNCH = """
import subprocess, sys
p = subprocess.Popen([sys.executable, "-m", "shardserve.server", "serve", *sys.argv[1:]])
print(p.pid, flush=True)
sys.exit(p.wait())
"""


def rollup_mib(pid: int) -> tuple[float, float]:
    """``(Private_Clean + Private_Dirty, Anonymous)`` of ``pid`` in MiB."""
    fields = smaps_rollup_kib(pid)
    return (fields["Private_Clean"] + fields["Private_Dirty"]) / 1024, fields["Anonymous"] / 1024


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def one_start(procs: int, env: dict[str, str]) -> list[tuple[float, float]]:
    """Private and anonymous MiB of the main process, then of each streaming process."""
    with tempfile.TemporaryDirectory(prefix="ss-idle-") as tmp:
        work = Path(tmp)
        args = ["--store", str(work / "store"), "--create", "--http", "127.0.0.1:0"]
        args += ["--data", "tcp://127.0.0.1:0", "--ipc", str(work / "ss.sock")]
        args += ["--ready-file", str(work / "ready.json"), "--stream-processes", str(procs)]
        with open(work / "server.log", "wb") as log:
            launcher = subprocess.Popen(
                [sys.executable, "-c", LAUNCH, *args],
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
            )
        assert launcher.stdout is not None
        pid = int(launcher.stdout.readline())
        try:
            deadline = time.monotonic() + 120
            while not (work / "ready.json").exists():
                if launcher.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((work / "server.log").read_text()[-2000:])
                time.sleep(0.05)  # polling the ready file with a deadline
            time.sleep(SETTLE_S)  # the streaming processes finish starting
            return [rollup_mib(p) for p in [pid, *children(pid)]]
        finally:
            os.kill(pid, 15)
            launcher.wait(timeout=30)


def measure(procs: int, starts: int, env: dict[str, str]) -> dict[str, list[float]]:
    """Median over ``starts`` of each process's private and anonymous MiB."""
    runs = [one_start(procs, env) for _ in range(starts)]
    width = min(len(r) for r in runs)
    return {
        "private_mib": [round(statistics.median(r[i][0] for r in runs), 1) for i in range(width)],
        "anonymous_mib": [round(statistics.median(r[i][1] for r in runs), 1) for i in range(width)],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--starts", type=int, default=3, help="servers started per row (median)")
    p.add_argument("--processes", default="1,2", help="comma-separated --stream-processes")
    p.add_argument("--baseline", type=Path, default=None, help="another checkout's packages")
    args = p.parse_args()
    res: dict = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "target_mib": TARGET_MIB,
        "rows": {},
    }
    with tempfile.TemporaryDirectory(prefix="ss-idle-code-") as links:
        codes = {"this": dict(os.environ)}
        if args.baseline is not None:
            here = Path(links) / "shardserve"
            here.mkdir()
            for pkg in ("server", "client", "proto"):
                (here / pkg).symlink_to(ROOT / pkg)
            codes = {
                "baseline": {**os.environ, "PYTHONPATH": str(args.baseline)},
                "this": {**os.environ, "PYTHONPATH": links},
            }
        measure_codes(codes, args.processes, args.starts, res)
    res["load_after"] = os.getloadavg()
    print(f"load average before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2))
    print(f"wrote {RESULTS}")


def compile_bytecode(env: dict[str, str]) -> None:
    """Write the ``__pycache__`` of the shardserve that ``env`` imports (quietly)."""
    where = [sys.executable, "-c", "import shardserve.server as s; print(s.__path__[0])"]
    server = Path(
        subprocess.run(where, env=env, capture_output=True, text=True, check=True).stdout.strip()
    )
    pkgs = [str(server.parent / p) for p in ("server", "client", "proto")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *pkgs], env=env, check=True)


def measure_codes(codes: dict[str, dict[str, str]], processes: str, starts: int, res: dict) -> None:
    """One row in ``res["rows"]`` per code and ``--stream-processes`` count, printed."""
    for code, env in codes.items():
        compile_bytecode(env)
        for procs in (int(c) for c in processes.split(",")):
            row = measure(procs, starts, env)
            res["rows"][f"{code}, {procs} process(es)"] = row
            worst = max(row["private_mib"])
            print(
                f"{code:8} --stream-processes {procs}: private MiB (main, streaming...) "
                f"{row['private_mib']}, anonymous {row['anonymous_mib']}; target "
                f"<= {TARGET_MIB:.0f}: {'met' if worst <= TARGET_MIB else 'MISSED'}",
                flush=True,
            )


if __name__ == "__main__":
    main()
