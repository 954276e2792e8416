"""Ranks on one sidecar: 1, 2 and 4 trainer processes of one job, aggregate throughput.

    python bench/bench_scaling.py [--quick] [--ranks 1,2,4] [--processes 1,2] [--workdir DIR]

One server (one sidecar per node), one job of world size ``N``: ``N`` processes, each a
``Loader`` of its rank over shared memory, reading one epoch together (so each reads
``1/N`` of it). Two workloads on the same 50,000 CIFAR-like samples (``--quick``: 8,000),
batch 256:

* ``raw``: the stored ``uint8`` images and labels;
* ``chain``: ``random_crop`` + ``hflip`` + ``normalize`` to float32 on the server (the
  CIFAR chain of ``bench_transforms``).

Every rank starts each epoch at a barrier; epoch 0 warms up, then the next epochs are timed
from the barrier to the last rank's last batch (10 epochs raw, 2 with the chain: a raw epoch
takes ~40 ms, too short to time alone). Reported per row: aggregate samples/s, its ratio to
one rank, the server's CPU (its process tree, streaming processes included) per batch, and
the load average. ``--processes``: the server runs with each ``--stream-processes`` in turn
(1: the main process serves every stream); each server's idle private memory (smaps_rollup
``Private_Clean + Private_Dirty``) of the main process and of each streaming process is
recorded before its first job. The target is ``>= 6x`` one rank at 8 ranks on a 16-core
host; on a 2-core machine the server and two trainers share two cores, which bounds it.
Writes ``bench/results/scaling.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _loops import server_pid
from _small_data import make_cifar
from bench_memory import private_kib
from bench_transforms import CIFAR_CHAIN, tree_cpu

from shardserve.client import serve_local

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results" / "scaling.json"
BATCH = 256
WORKLOADS: dict[str, list[dict[str, Any]] | None] = {"raw": None, "chain": CIFAR_CHAIN}
#: Epochs timed after the warm-up one, per workload.
TIMED_EPOCHS = {"raw": 10, "chain": 2}


def rank_main(
    url: str,
    rank: int,
    world: int,
    chain: list[dict[str, Any]] | None,
    epochs: int,
    barrier: Any,
    out: Any,
) -> None:
    """One trainer process: epoch 0 to warm up, then ``epochs`` epochs timed from the barrier."""
    import torch

    from shardserve.client import Loader

    torch.set_num_threads(1)
    with Loader(
        url, "cifar", BATCH, seed=0, rank=rank, world_size=world, transforms=chain, timeout=300
    ) as ld:
        ld.set_epoch(0)
        barrier.wait(timeout=600)
        for _ in ld:
            pass
        barrier.wait(timeout=600)
        t0, n = time.time(), 0
        for epoch in range(1, epochs + 1):
            ld.set_epoch(epoch)
            for b in ld:
                n += len(b["label"])
        out.put((rank, t0, time.time(), n))


def run(
    url: str, server: int, world: int, chain: list[dict[str, Any]] | None, epochs: int
) -> dict[str, float]:
    ctx = mp.get_context("spawn")  # a fresh interpreter per rank, as torchrun starts them
    # The ranks and this process: it learns when the timed epoch starts (every rank is done
    # with the warm-up one), to count the server's CPU over the timed epochs only.
    barrier, out = ctx.Barrier(world + 1), ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(url, r, world, chain, epochs, barrier, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    barrier.wait(timeout=600)  # epoch 0 starts
    barrier.wait(timeout=900)  # the timed epochs start
    cpu0 = tree_cpu(server, reaped=True)
    got = [out.get(timeout=900) for _ in range(world)]
    cpu = tree_cpu(server, reaped=True) - cpu0
    for p in procs:
        p.join(timeout=60)
    start, end = min(g[1] for g in got), max(g[2] for g in got)
    samples = sum(g[3] for g in got)
    return {
        "ranks": world,
        "samples_s": samples / (end - start),
        "epochs": epochs,
        "timed_s": end - start,
        "server_cpu_ms_per_batch": cpu / (samples / BATCH) * 1e3,
    }


def measure(store: Path, procs: int, worlds: list[int], rows: dict[str, Any]) -> list[float]:
    """Every workload and world size on a server of ``procs`` streaming processes, into
    ``rows``; the idle private MiB of its main process, then of each streaming process."""
    suffix = "" if procs == 1 else f", {procs} processes"
    with serve_local(store, "--stream-processes", str(procs)) as url:
        pid = server_pid(store)
        if pid is None:
            raise RuntimeError(f"no server process for {store}")
        idle = [private_kib(p) / 1024 for p in [pid, *streaming_pids(pid)]]
        print(f"{procs} process(es): idle private MiB " + ", ".join(f"{m:.1f}" for m in idle))
        for name, chain in WORKLOADS.items():
            for world in worlds:
                row = run(url, pid, world, chain, TIMED_EPOCHS[name])
                rows[f"{name}, {world} rank{'s' * (world > 1)}{suffix}"] = row
                one = rows.get(f"{name}, 1 rank{suffix}", {}).get("samples_s")
                row["vs_one_rank"] = row["samples_s"] / one if one else float("nan")
                base = rows.get(f"{name}, {world} rank{'s' * (world > 1)}", {}).get("samples_s")
                row["vs_one_process"] = row["samples_s"] / base if base else float("nan")
                print(
                    f"{name:6} ranks {world} processes {procs}: {row['samples_s']:>10,.0f} "
                    f"samples/s ({row['vs_one_rank']:.2f}x one rank, "
                    f"{row['vs_one_process']:.2f}x one process), server "
                    f"{row['server_cpu_ms_per_batch']:.2f} ms CPU/batch",
                    flush=True,
                )
    return idle


def streaming_pids(pid: int) -> list[int]:
    """The streaming processes of server ``pid`` (its children running the child module)."""
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if b"shardserve.server.processes.child" in cmd:
            out.append(int(child))
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="8,000 samples instead of 50,000")
    p.add_argument("--ranks", default="1,2,4", help="comma-separated world sizes")
    p.add_argument("--processes", default="1", help="comma-separated --stream-processes")
    p.add_argument("--workdir", type=Path, default=None, help="where to write the data")
    args = p.parse_args()
    n = 8_000 if args.quick else 50_000
    worlds = [int(w) for w in args.ranks.split(",")]
    counts = [int(c) for c in args.processes.split(",")]
    res: dict[str, Any] = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} cpus={os.cpu_count()}",
        "quick": args.quick,
        "samples": n,
        "batch": BATCH,
        "load_before": os.getloadavg(),
        "rows": {},
        "idle_private_mib": {},
    }
    with tempfile.TemporaryDirectory(prefix="ss-bench-scaling-", dir=args.workdir) as tmp:
        store = Path(tmp) / "store"
        make_cifar(store, n)
        for procs in counts:
            res["idle_private_mib"][procs] = measure(store, procs, worlds, res["rows"])
    res["load_after"] = os.getloadavg()
    print(
        f"load average before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f} "
        f"({os.cpu_count()} cpus)"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
