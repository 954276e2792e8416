"""Pool sizes chosen from the machine: cgroup files, affinity, and flag > env > machine."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from shardserve.server.runtime.sizing import Machine, choose, probe
from shardserve.server.settings import Settings
from tests.support.server import run_server
from tests.support.slowness import scaled

GIB = 1 << 30


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _probe(tmp_path: Path, cores: int, cgroup: str = "0::/\n") -> Machine:
    _write(tmp_path / "proc_cgroup", cgroup)
    _write(tmp_path / "meminfo", f"MemTotal:       {64 * GIB // 1024} kB\nMemFree: 1 kB\n")
    return probe(
        tmp_path / "cg", tmp_path / "proc_cgroup", tmp_path / "meminfo", lambda: set(range(cores))
    )


def test_v2_cpu_max_and_memory_max_bound_the_host(tmp_path: Path) -> None:
    """A cgroup v2 quota of 4 CPUs and a 6 GiB memory.max win over 32 cores and 64 GiB."""
    _write(tmp_path / "cg/cpu.max", "400000 100000\n")
    _write(tmp_path / "cg/memory.max", f"{6 * GIB}\n")
    m = _probe(tmp_path, 32)
    assert (m.cpus, m.memory_bytes) == (4.0, 6 * GIB)
    assert "cpu.max" in m.cpu_reason and "memory.max" in m.memory_reason


def test_v2_limit_in_a_parent_cgroup_applies(tmp_path: Path) -> None:
    """A quota on the parent of this process's cgroup bounds it like its own."""
    _write(tmp_path / "cg/kubepods/cpu.max", "200000 100000\n")
    _write(tmp_path / "cg/kubepods/pod1/cpu.max", "max 100000\n")
    _write(tmp_path / "cg/kubepods/pod1/memory.max", "max\n")
    m = _probe(tmp_path, 16, "0::/kubepods/pod1\n")
    assert m.cpus == 2.0
    assert m.memory_bytes == 64 * GIB and m.memory_reason == "MemTotal"


def test_v1_quota_and_memory_limit(tmp_path: Path) -> None:
    """cgroup v1 cpu.cfs_quota_us/cpu.cfs_period_us and memory.limit_in_bytes are read."""
    _write(tmp_path / "cg/cpu,cpuacct/cpu.cfs_quota_us", "300000\n")
    _write(tmp_path / "cg/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "cg/memory/memory.limit_in_bytes", f"{3 * GIB}\n")
    m = _probe(tmp_path, 8, "4:cpu,cpuacct:/\n3:memory:/\n")
    assert (m.cpus, m.memory_bytes) == (3.0, 3 * GIB)
    assert "cfs_quota_us" in m.cpu_reason


def test_v1_unlimited_and_no_cgroup_fall_back_to_affinity(tmp_path: Path) -> None:
    """Quota -1, a v1 'unlimited' memory limit and a missing cgroup tree leave the host's figures."""
    _write(tmp_path / "cg/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "cg/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "cg/memory/memory.limit_in_bytes", "9223372036854771712\n")
    m = _probe(tmp_path, 6, "4:cpu,cpuacct:/\n3:memory:/\n")
    assert (m.cpus, m.memory_bytes) == (6.0, 64 * GIB)
    assert "affinity" in m.cpu_reason


def test_affinity_below_quota_wins(tmp_path: Path) -> None:
    """A process pinned to 3 cores gets 3 even under an 8-CPU quota."""
    _write(tmp_path / "cg/cpu.max", "800000 100000\n")
    assert _probe(tmp_path, 3).cpus == 3.0


@pytest.mark.parametrize(
    ("cpus", "memory", "workers", "threads", "shm", "procs"),
    [
        (2, 23 * GIB, 2, 2, 4 * GIB, 1),  # today's defaults on the CI machine
        (1.5, 8 * GIB, 2, 2, 2 * GIB, 1),
        (16, 128 * GIB, 8, 4, 4 * GIB, 4),
        (96, 512 * GIB, 32, 8, 4 * GIB, 8),
        (16, 2 * GIB, 4, 4, GIB // 2, 4),  # memory caps the worker processes
    ],
)
def test_choose(cpus: float, memory: int, workers: int, threads: int, shm: int, procs: int) -> None:
    """The machine's CPUs and memory give these defaults; 2 CPUs give the old ones."""
    s = choose(Machine(cpus, "c", memory, "m"), given={})
    assert s.applied() == {
        "transform_workers": workers,
        "assembly_threads": threads,
        "shm_limit_bytes": shm,
        "stream_processes": procs,
    }
    assert "transform_workers=" in s.line() and f"stream_processes={procs}" in s.line()


def test_flag_and_env_beat_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A keyword (the flag) wins over the environment, which wins over the machine."""
    monkeypatch.setenv("SHARDSERVE_TRANSFORM_WORKERS", "5")
    monkeypatch.setenv("SHARDSERVE_ASSEMBLY_THREADS", "3")
    s = Settings(store=Path("/nonexistent"), transform_workers=7)
    assert (s.transform_workers, s.assembly_threads) == (7, 3)
    given = {c.name: c.given for c in s.sizing.choices}
    assert given["transform_workers"] and given["assembly_threads"]
    assert not given["shm_limit_bytes"]


def test_server_states_its_sizing(cifar_store: Path, tmp_path: Path) -> None:
    """A real server logs and shows on its status page each pool size and why, flag and env kept."""
    env = {"SHARDSERVE_ASSEMBLY_THREADS": "3"}
    args = ("--state-dir", str(tmp_path), "--transform-workers", "5")
    with run_server(cifar_store, *args, env=env) as srv:
        r = httpx.get(f"{srv.http_url}/", headers=srv.headers, timeout=scaled(10))
        assert r.status_code == 200, r.text
        line = r.text.split('id="sizing">', 1)[1].split("</p>", 1)[0]
        assert "transform workers <b>5</b> (given)" in line
        assert "assembly threads <b>3</b> (given)" in line
        assert "shm limit bytes <b>" in line and "a quarter of memory" in line
        assert "stream processes <b>1</b>" in line and "CPUs (" in line
        pool = httpx.get(f"{srv.http_url}/v1/transforms", headers=srv.headers, timeout=scaled(10))
        assert pool.json()["pool"]["size"] == 5
        log = srv.log_tail()
        assert "serve.sizing" in log and "transform_workers=5 (given)" in log


def test_remote_store_keeps_one_streaming_process(tmp_path: Path) -> None:
    """A remote store is served by one process: sized to 1, and refused above 1 naming the flag."""
    s = Settings(store="s3://bucket/store", cache_dir=tmp_path)
    assert s.stream_processes == 1
    with pytest.raises(ValueError, match="--stream-processes above 1 needs a local store"):
        Settings(store="s3://bucket/store", cache_dir=tmp_path, stream_processes=2)
