"""What the benchmarks read of a process from ``/proc``, in a module that imports nothing else.

``bench_idle.py`` measures how much of a server's memory no other process shares: the
process it runs in must not map the server's libraries itself, so it cannot import
``_support`` (numpy, pyarrow, pyzmq) for this.
"""

from __future__ import annotations


def smaps_rollup_kib(pid: int) -> dict[str, int]:
    """The kB fields of ``/proc/PID/smaps_rollup`` (``Private_Clean``, ``Anonymous``, ...)."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                fields[key] = int(rest.split()[0])
    return fields
