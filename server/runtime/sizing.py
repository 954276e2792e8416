"""Pool sizes chosen from the machine the server may use: its CPUs and memory as the cgroup,
the CPU affinity and ``/proc/meminfo`` allow, not as the host has them.

:func:`probe` reads what the process may use (pure file reads, no subprocess); :func:`choose`
turns that into the defaults of the settings it sizes, each with the reason it was chosen.
A setting given as a flag or ``SHARDSERVE_*`` variable is kept as given. Two CPUs give the
same defaults as before sizing existed (tests and the 2-core measurements rely on that).

>>> m = Machine(cpus=16, cpu_reason="16 cores", memory_bytes=64 << 30, memory_reason="64 GiB")
>>> s = choose(m, given={})
>>> s.value("transform_workers"), s.value("assembly_threads"), s.value("stream_processes")
(8, 4, 4)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

#: Sizes never grow past these, whatever the machine (a 256-core host does not need 128 threads
#: gathering batches: the page cache and the sockets bound them long before).
MAX_TRANSFORM_WORKERS = 32
MAX_ASSEMBLY_THREADS = 8
#: Streaming processes sized from the machine at most (more may be given with the flag).
MAX_STREAM_PROCESSES = 8
#: Most streaming processes the flag may ask for (stream ids give each process 2**26 of them:
#: see ``proto.processes.STREAM_ID_BITS``).
STREAM_PROCESSES_FLAG_MAX = 63
#: Memory one transform worker process may take (a decoded batch, the interpreter, its imports).
WORKER_BYTES = 512 << 20
#: The shared-memory budget of every slot ring together takes at most this share of memory.
SHM_SHARE = 4
#: The shared-memory budget when memory allows it (the default before sizing existed).
SHM_LIMIT_BYTES = 4 << 30
#: A cgroup v1 memory limit at or above this means "no limit" (the kernel writes ~2**63).
_V1_UNLIMITED = 1 << 60

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class Machine:
    """What this process may use: ``cpus`` (may be fractional under a CPU quota) and
    ``memory_bytes``, each with where the figure came from."""

    cpus: float
    cpu_reason: str
    memory_bytes: int
    memory_reason: str


@dataclass(frozen=True)
class Choice:
    """One sized setting: its ``value`` and why (``given``: a flag or variable set it)."""

    name: str
    value: int
    reason: str
    given: bool


@dataclass(frozen=True)
class Sizing:
    """Every sized setting of one server, and the machine they were chosen for."""

    machine: Machine
    choices: tuple[Choice, ...]

    def value(self, name: str) -> int:
        """The chosen value of setting ``name``."""
        return next(c.value for c in self.choices if c.name == name)

    def applied(self) -> dict[str, int]:
        """The settings this sizing sets."""
        return {c.name: c.value for c in self.choices}

    def line(self) -> str:
        """One log line: each choice and why."""
        m = self.machine
        parts = [f"{c.name}={c.value} ({c.reason})" for c in self.choices]
        return (
            f"cpus {m.cpus:g} ({m.cpu_reason}), memory {_gib(m.memory_bytes)} "
            f"({m.memory_reason}): " + "; ".join(parts)
        )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """Controller (``""`` for cgroup v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            out[controller] = parts[2]
    return out


def _ancestors(root: Path, rel: str) -> list[Path]:
    """``root/rel`` and each folder above it up to ``root`` (a limit anywhere above applies)."""
    here = root / rel.lstrip("/")
    out = [here, *here.parents]
    return [p for p in out if p == root or root in p.parents] or [root]


def _v2_cpu(folders: Iterable[Path]) -> tuple[float, str] | None:
    best: tuple[float, str] | None = None
    for folder in folders:
        text = _read(folder / "cpu.max")
        if text is None or text.startswith("max"):
            continue
        quota, _, period = text.partition(" ")
        try:
            cpus = int(quota) / int(period or "100000")
        except ValueError:
            continue
        if cpus > 0 and (best is None or cpus < best[0]):
            best = (cpus, f"cgroup v2 cpu.max {text}")
    return best


def _v1_cpu(folders: Iterable[Path]) -> tuple[float, str] | None:
    for folder in folders:
        quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
        if quota is None or period is None:
            continue
        try:
            q, p = int(quota), int(period)
        except ValueError:
            continue
        if q > 0 and p > 0:
            return q / p, f"cgroup v1 cpu.cfs_quota_us {q} / cpu.cfs_period_us {p}"
    return None


def _v2_memory(folders: Iterable[Path]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for folder in folders:
        text = _read(folder / "memory.max")
        if text is None or not text.isdigit():
            continue  # "max": no limit here
        if best is None or int(text) < best[0]:
            best = (int(text), "cgroup v2 memory.max")
    return best


def _v1_memory(folders: Iterable[Path]) -> tuple[int, str] | None:
    for folder in folders:
        text = _read(folder / "memory.limit_in_bytes")
        if text is not None and text.isdigit() and int(text) < _V1_UNLIMITED:
            return int(text), "cgroup v1 memory.limit_in_bytes"
    return None


def _meminfo_total(meminfo: Path) -> int | None:
    for line in (_read(meminfo) or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def probe(
    root: Path = CGROUP_ROOT,
    proc_cgroup: Path = PROC_CGROUP,
    meminfo: Path = MEMINFO,
    affinity: Callable[[], set[int]] | None = None,
) -> Machine:
    """The CPUs and memory this process may use: the least of the CPU affinity and a cgroup
    v2 (``cpu.max``) or v1 (``cpu.cfs_quota_us``) quota; the least of ``MemTotal`` and a
    cgroup memory limit. The paths are parameters so that tests point them at folders.

    >>> probe().cpus >= 1
    True
    """
    cores = len((affinity or (lambda: os.sched_getaffinity(0)))())
    paths = _cgroup_paths(proc_cgroup)
    v2 = _ancestors(root, paths.get("", "/"))
    v1_cpu = [
        *_ancestors(root / "cpu,cpuacct", paths.get("cpu", "/")),
        *_ancestors(root / "cpu", paths.get("cpu", "/")),
    ]
    v1_mem = _ancestors(root / "memory", paths.get("memory", "/"))
    cpus, cpu_reason = float(cores), f"{cores} cores in the CPU affinity"
    quota = _v2_cpu(v2) or _v1_cpu(v1_cpu)
    if quota is not None and quota[0] < cpus:
        cpus, cpu_reason = quota
    total = _meminfo_total(meminfo)
    memory, memory_reason = (total, "MemTotal") if total else (8 << 30, "unknown: assumed 8 GiB")
    limit = _v2_memory(v2) or _v1_memory(v1_mem)
    if limit is not None and limit[0] < memory:
        memory, memory_reason = limit
    return Machine(cpus, cpu_reason, memory, memory_reason)


def _sized(name: str, given: Mapping[str, int], value: int, reason: str) -> Choice:
    if name in given:
        return Choice(name, given[name], "given", True)
    return Choice(name, value, reason, False)


def one_process(given: Mapping[str, int]) -> dict[str, int]:
    """``given`` for a server of a remote store: one streaming process, the one that keeps
    the store's shard cache; more given is refused, naming the flag.

    >>> one_process({})
    {'stream_processes': 1}
    """
    if given.get("stream_processes", 1) > 1:
        raise ValueError(
            "--stream-processes above 1 needs a local store: a remote store's shard cache is "
            "kept by one process; pass --stream-processes 1, or serve a local copy of the store"
        )
    return {**given, "stream_processes": 1}


def choose(machine: Machine, given: Mapping[str, int]) -> Sizing:
    """The sized settings for ``machine``; those in ``given`` (set by flag or variable) stay.

    Transform workers take half the CPUs (the trainers on the node need the rest), at least 2
    and no more than memory holds at :data:`WORKER_BYTES` each; assembly threads a quarter, at
    least 2; the shared-memory budget a quarter of memory, at most 4 GiB; streaming processes
    a quarter of the CPUs, at least 1 (so a 2-core machine keeps one process: there the
    trainer and one process already fill both cores).

    >>> m = Machine(cpus=2, cpu_reason="", memory_bytes=2 << 30, memory_reason="")
    >>> choose(m, {"transform_workers": 6}).applied()
    {'transform_workers': 6, 'assembly_threads': 2, 'shm_limit_bytes': 536870912, 'stream_processes': 1}
    """
    cores = max(1, math.floor(machine.cpus))
    by_memory = max(1, machine.memory_bytes // WORKER_BYTES)
    workers = min(max(2, cores // 2), MAX_TRANSFORM_WORKERS, max(2, by_memory))
    w_reason = f"half of {cores} CPUs, at least 2" + (
        f", memory for {by_memory}" if workers == max(2, by_memory) < cores // 2 else ""
    )
    threads = min(max(2, cores // 4), MAX_ASSEMBLY_THREADS)
    shm = min(SHM_LIMIT_BYTES, machine.memory_bytes // SHM_SHARE)
    streams = min(max(1, cores // 4), MAX_STREAM_PROCESSES)
    return Sizing(
        machine,
        (
            _sized("transform_workers", given, workers, w_reason),
            _sized("assembly_threads", given, threads, f"a quarter of {cores} CPUs, at least 2"),
            _sized("shm_limit_bytes", given, shm, "a quarter of memory, at most 4 GiB"),
            _sized("stream_processes", given, streams, f"a quarter of {cores} CPUs, at least 1"),
        ),
    )
