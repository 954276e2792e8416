"""Server memory benchmark: the seed workload that exposed the private copy of every shard.

    python bench/bench_memory.py [--quick] [--workdir DIR]

Writes 2,000 latent samples of 256 KiB (``float32[64,32,32]``, 500 MiB; ``--quick``: 400,
100 MiB), starts a real ``shardserve serve`` and streams one epoch to 2 DDP ranks (two client
processes with ``RANK``/``WORLD_SIZE``, global shuffle, batch 16). While they run it samples the
server's ``/proc/PID/status`` every 20 ms:

* ``RssAnon``  private anonymous memory: what the server itself allocated (the bug: a copy of
  every shard made at open). Target: what the dataset adds to it (peak minus the server's
  once its read path is loaded, by one epoch of a 2-sample dataset before: pyarrow loads with
  the first job read) under 10 % of the dataset; the idle
  server's itself <= 60 MiB (the libraries' code pages are file pages, counted in RssFile;
  this bench maps pyarrow too, so its pages count as shared here: ``bench_idle.py`` measures
  a server no other process shares its libraries with);
* ``RssFile``  mapped file pages, i.e. the page cache shared with every other process (one copy
  of the dataset, the design; counted once per mapping, and the fixed fields of a dataset of
  several shards are mapped twice, once stitched across shards: up to twice the dataset);
* ``RssShmem`` the shared-memory slot rings (the clients' prefetch).

Figures are ratios against the dataset's bytes in the same run. Writes JSON to
``bench/results/memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from _proc import smaps_rollup_kib
from _support import run_server

from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.write.writer import ShardWriter

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_SHAPE = (64, 32, 32)  # float32: 256 KiB
BATCH = 16
WORLD = 2
#: Samples of the dataset read first, which loads the read path (see the module doc).
WARM_SAMPLES = 2
#: The target for the idle server's private memory, before any dataset.
IDLE_TARGET_KIB = 60 << 10
#: The idle server's private memory (smaps_rollup Private_Clean + Private_Dirty, KiB) on the
#: 2-core dev machine before pyarrow.compute and tqdm were imported at first use (median of 3
#: starts, load 1.8): the "before" of the idle row; this run's figure is its "after".
IDLE_PRIVATE_BEFORE_KIB = 67_288

RANK_SCRIPT = """
import sys, time
from shardserve.client import Loader
url, n, BATCH = sys.argv[1], 0, int(sys.argv[2])
loader = Loader(url, dataset=sys.argv[3], batch_size=BATCH, seed=0, timeout=120)
t0 = time.perf_counter()
first = None
for batch in loader:
    if first is None:
        first = time.perf_counter() - t0
    n += batch["z"].shape[0]
print(n, round(first, 4), round(time.perf_counter() - t0, 3))
loader.close()
"""


def write_latents(store: Path, n: int, name: str = "latents") -> int:
    fields = [FieldSpec(name="z", dtype="float32", shape=SAMPLE_SHAPE)]
    rng = np.random.default_rng(0)
    block = rng.standard_normal((100, *SAMPLE_SHAPE), dtype=np.float32)
    with ShardWriter(store, name, fields=fields) as w:
        for start in range(0, n, 100):
            k = min(100, n - start)
            w.add_batch({"z": block[:k]})
    assert w.manifest is not None
    return w.manifest.total_bytes


def status_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[key] = int(rest.split()[0])
    return out


def private_kib(pid: int) -> int:
    """Pages only ``pid`` maps (``Private_Clean + Private_Dirty`` of smaps_rollup): its anonymous
    memory and the library pages no other process shares with it."""
    fields = smaps_rollup_kib(pid)
    return fields["Private_Clean"] + fields["Private_Dirty"]


class Sampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, {}, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            with_err = status_kib(self.pid)
            for k, v in with_err.items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            time.sleep(0.02)  # sampling interval


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args(argv)
    n = 400 if args.quick else 2000
    with tempfile.TemporaryDirectory(prefix="ss-mem-", dir=args.workdir) as tmp:
        store = Path(tmp) / "store"
        nbytes = write_latents(store, n)
        write_latents(store, WARM_SAMPLES, "warm")
        with run_server(store, timeout=60) as srv:
            pid = srv.proc.pid
            idle = status_kib(pid)
            idle_private = private_kib(pid)
            env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": str(WORLD)}
            # The read path (pyarrow) loads with the first job read: a fixed cost, not the
            # dataset's. One epoch of a tiny dataset first, so the growth is the dataset's.
            subprocess.run(
                [sys.executable, "-c", RANK_SCRIPT, srv.http_url, str(WARM_SAMPLES), "warm"],
                env={**env, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"},
                stdout=subprocess.DEVNULL,
                check=True,
                timeout=120,
            )
            warm = status_kib(pid)
            sampler = Sampler(pid)
            sampler.start()
            t0 = time.perf_counter()
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", RANK_SCRIPT, srv.http_url, str(BATCH), "latents"],
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for r in range(WORLD)
            ]
            outs = [p.communicate(timeout=600)[0].split() for p in procs]
            wall = time.perf_counter() - t0
            sampler.stop.set()
            sampler.join()
            after = status_kib(pid)
            if any(p.returncode for p in procs):
                print("a rank failed", outs, srv.log_tail(), file=sys.stderr)
                return 1
    samples = sum(int(o[0]) for o in outs)
    mib = 1 << 20
    peak_anon = sampler.peak["RssAnon"] * 1024
    result = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "samples": n,
        "dataset_bytes": nbytes,
        "delivered_samples": samples,
        "wall_s": round(wall, 2),
        "first_batch_s": [float(o[1]) for o in outs],
        "idle_kib": idle,
        "idle_target_kib": IDLE_TARGET_KIB,
        "idle_met": idle["RssAnon"] <= IDLE_TARGET_KIB,
        "idle_private_kib": idle_private,
        "idle_private_before_kib": IDLE_PRIVATE_BEFORE_KIB,
        "peak_kib": sampler.peak,
        "after_kib": after,
        "peak_private_over_dataset": round(peak_anon / nbytes, 4),
        "warm_kib": warm,
        "private_growth_over_dataset": round((peak_anon - warm["RssAnon"] * 1024) / nbytes, 4),
    }
    print(
        f"dataset {nbytes / mib:.0f} MiB ({n} x 256 KiB), {WORLD} ranks, {samples} samples "
        f"delivered in {wall:.1f} s; first batch after {result['first_batch_s']} s"
    )
    print(f"{'server memory':<28}{'idle MiB':>10}{'peak MiB':>10}{'peak / dataset':>16}")
    for key, what in (
        ("RssAnon", "private (RssAnon)"),
        ("RssFile", "mapped files (RssFile)"),
        ("RssShmem", "slot rings (RssShmem)"),
    ):
        pk = sampler.peak.get(key, 0) * 1024
        print(f"{what:<28}{idle.get(key, 0) / 1024:>10.1f}{pk / mib:>10.1f}{pk / nbytes:>16.3f}")
    print(
        f"idle server before any dataset: private (RssAnon) {idle['RssAnon'] / 1024:.1f} MiB "
        f"(target <= {IDLE_TARGET_KIB / 1024:.0f} MiB: {'met' if result['idle_met'] else 'MISSED'})"
    )
    print(
        f"idle server private (smaps_rollup): {idle_private / 1024:.1f} MiB, before lazy imports "
        f"{IDLE_PRIVATE_BEFORE_KIB / 1024:.1f} MiB; load average {os.getloadavg()[0]:.2f}"
    )
    out = ROOT / "bench" / "results" / "memory.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    ok = result["private_growth_over_dataset"] < 0.10
    print(
        f"private memory (peak - read path loaded) / dataset = {result['private_growth_over_dataset']:.3f} "
        f"({'under' if ok else 'OVER'} the 0.10 target); peak / dataset = "
        f"{result['peak_private_over_dataset']:.3f}; JSON: {out}"
    )
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
