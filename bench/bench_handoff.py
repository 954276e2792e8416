"""What one wake-up of another thread or process costs on this machine: the tax on every
hand-off the sidecar makes (a batch to the assembly pool and back, a message to the client,
its credit back to the server).

Two threads (and then two processes) pass a byte back and forth through pipes, each blocking
in ``read`` until the other writes, as the streamer waits in its poller and the pool's threads
on their queue. Timed: the round trip's wall time and the CPU both sides spend on it, with
both ends pinned to one core, then to two different cores (where the other end must be woken
on a core of its own: on a virtual machine that is an interrupt through the hypervisor).
Prints a table with the load average and writes ``bench/results/handoff.json``. Numbers from
this machine and from a host with other cores read side by side: a design that hands a batch
between threads several times loses on a machine whose wake-ups are slow.

    python bench/bench_handoff.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "handoff.json"


def _echo(cpu: int, rd: int, wr: int, n: int) -> None:
    """The far end: pinned to ``cpu``, answer each byte read from ``rd`` with one on ``wr``."""
    os.sched_setaffinity(0, {cpu})  # this thread or process only
    for _ in range(n):
        os.read(rd, 1)
        os.write(wr, b"x")


def round_trip(n: int, cpus: tuple[int, int], process: bool) -> dict[str, float]:
    """Round trips between this thread on ``cpus[0]`` and a thread (or a process) on
    ``cpus[1]`` answering it."""
    to_peer, from_peer = os.pipe(), os.pipe()
    args = (cpus[1], to_peer[0], from_peer[1], n)
    peer: threading.Thread | mp.process.BaseProcess
    if process:
        peer = mp.get_context("fork").Process(target=_echo, args=args)
    else:
        peer = threading.Thread(target=_echo, args=args)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})
    try:
        peer.start()
        os.write(to_peer[1], b"x")  # one round trip first: both ends are running and pinned
        os.read(from_peer[0], 1)
        wall0, cpu0 = time.perf_counter(), _cpu()
        for _ in range(n - 1):
            os.write(to_peer[1], b"x")
            os.read(from_peer[0], 1)
        wall = time.perf_counter() - wall0
        peer.join()
        cpu = _cpu() - cpu0  # both ends: a process peer's CPU counts once it has been joined
    finally:
        os.sched_setaffinity(0, before)
        for fd in (*to_peer, *from_peer):
            os.close(fd)
    return {"wall_us": wall / (n - 1) * 1e6, "cpu_us": cpu / (n - 1) * 1e6}


def _cpu() -> float:
    """CPU of this process (both threads) and of its children that have ended."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2,000 round trips a row")
    args = p.parse_args(argv)
    n = 2_000 if args.quick else 20_000
    cores = sorted(os.sched_getaffinity(0))
    other = cores[1] if len(cores) > 1 else None
    load_before, machine = os.getloadavg(), f"{platform.machine()} cpus={os.cpu_count()}"
    cases: dict[str, tuple[tuple[int, int], bool]] = {
        "threads, one core": ((cores[0], cores[0]), False),
    }
    if other is not None:
        cases["threads, two cores"] = ((cores[0], other), False)
        cases["processes, two cores"] = ((cores[0], other), True)
    rows = {label: round_trip(n, cpus, proc) for label, (cpus, proc) in cases.items()}
    load_after = os.getloadavg()
    result = {
        "machine": machine,
        "round_trips": n,
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "rows": rows,
    }
    print(
        f"{n} round trips a row; {machine}; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after"
    )
    print(f"  {'between':26}{'wall us':>10}{'cpu us':>10}")
    for label, r in rows.items():
        print(f"  {label:26}{r['wall_us']:>10.1f}{r['cpu_us']:>10.1f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
