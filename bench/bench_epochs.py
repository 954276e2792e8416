"""The first batch of each epoch: a new server, then later epochs of a large dataset.

``python bench/bench_epochs.py [--quick] [--n N] [--epochs E] [--new-servers K] [--workdir DIR]``

A dataset of ``n`` samples (5,000,000; ``--quick`` 2,000,000) of one ``int64`` each (so
the store is small and the plan is the work), global shuffle, batch 256, one Loader over
shared memory. Each epoch reads 200 batches, then the loop "trains" for 0.5 s (sleeps)
before the next ``set_epoch``, as a real epoch lasts far longer than planning the next
one. Per epoch: seconds from ``iter()`` to the first batch. The baseline in the same run is
what that wait was before the next epoch's order was planned while the current one streams:
``epoch_order`` of ``n`` samples in this process (median of 3). A new server's first batch
is also timed on ``--new-servers`` more new servers (default 5; median), as one is noisy on
a busy machine; with ``PYTHONPATH`` naming another checkout's packages, the servers run
that code (a baseline in the same run of the bench).

Then whole epochs of 50,000 CIFAR-like samples (``uint8[3,32,32]`` + label, batch 256,
shared memory, every batch's tensors touched): seconds per epoch, and the spread of epochs
1 to 5 (max / min).

Targets: first batch of each later epoch <= 20 ms at 5M samples; of a new
server's first epoch <= 0.3 s (its order is planned then, handed out after its first
bucket, see ``server/planning/cache.py``); CIFAR epochs spread <= 1.3. Writes
``bench/results/epochs.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _loops import touch
from _small_data import make_cifar
from _support import run_server

from shardserve.client import Loader
from shardserve.proto.manifest import FieldSpec
from shardserve.server.planning import epoch_order
from shardserve.server.store.write.writer import ShardWriter

HERE = Path(__file__).resolve().parent

RESULTS = HERE / "results" / "epochs.json"
TARGET_S = 0.020
FIRST_TARGET_S = 0.3
SPREAD_TARGET = 1.3
CIFAR_N = 50_000
BATCH = 256
READ_BATCHES = 200
TRAIN_S = 0.5


def make_store(root: Path, n: int) -> Path:
    store = root / f"store-{n}"
    if (store / "ints").exists():
        return store
    with ShardWriter(
        store, "ints", fields=[FieldSpec(name="x", dtype="int64", shape=())], shard_bytes=8 << 20
    ) as w:
        for s in range(0, n, 1 << 20):
            w.add_batch({"x": np.arange(s, min(n, s + (1 << 20)), dtype=np.int64)})
    return store


def first_batches(url: str, epochs: int) -> list[float]:
    out = []
    with Loader(url, "ints", BATCH, seed=0, prefetch=8) as loader:
        for e in range(epochs):
            loader.set_epoch(e)
            t0 = time.perf_counter()
            first = None
            for i, _ in enumerate(loader):
                if first is None:
                    first = time.perf_counter() - t0
                if i + 1 == READ_BATCHES:
                    break
            out.append(float(first or 0.0))
            time.sleep(TRAIN_S)  # the rest of the epoch's training
    return out


def new_server_firsts(store: Path, k: int) -> list[float]:
    """Seconds from ``iter()`` to the first batch of epoch 0 on each of ``k`` new servers."""
    out = []
    for _ in range(k):
        with run_server(store) as srv, Loader(srv.http_url, "ints", BATCH, seed=0) as loader:
            loader.set_epoch(0)
            t0 = time.perf_counter()
            next(iter(loader))
            out.append(time.perf_counter() - t0)
    return out


def cifar_epochs(url: str, epochs: int) -> list[float]:
    """Seconds of each whole CIFAR epoch (epoch 0 included: it opens the stream)."""
    out = []
    with Loader(url, "cifar", BATCH, seed=0) as loader:
        for e in range(epochs):
            loader.set_epoch(e)
            t0 = time.perf_counter()
            for b in loader:
                touch(b)
            out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2M samples, 4 epochs")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--new-servers", type=int, default=5, help="more new servers' first batch")
    p.add_argument("--workdir", type=Path, default=None, help="keep the data here")
    args = p.parse_args(argv)
    n = args.n or (2_000_000 if args.quick else 5_000_000)
    epochs = args.epochs or (4 if args.quick else 6)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ss-epochs-") as tmp:
        store = make_store(args.workdir or Path(tmp), n)
        if not (store / "cifar").exists():
            make_cifar(store, CIFAR_N)
        plans = []
        for _ in range(3):
            t0 = time.perf_counter()
            epoch_order(n, 0, 1, "global")
            plans.append(time.perf_counter() - t0)
        with run_server(store) as srv:
            firsts = first_batches(srv.http_url, epochs)
            cifar = cifar_epochs(srv.http_url, 6)
        news = [firsts[0], *new_server_firsts(store, args.new_servers)]
    later = statistics.median(firsts[1:])
    plan_s = statistics.median(plans)
    load_after = os.getloadavg()
    print(f"first batch of each epoch, {n:,} samples, global shuffle, batch {BATCH}, shm")
    for e, s in enumerate(firsts):
        print(
            f"  epoch {e}: {s * 1000:8.1f} ms" + ("  (a new server: plan, then gather)" * (e == 0))
        )
    print(f"  planning an epoch in-process (the wait before plan-ahead): {plan_s * 1000:.0f} ms")
    verdict = "met" if later <= TARGET_S else "MISSED"
    print(
        f"  later epochs, median: {later * 1000:.1f} ms = {later / plan_s:.3f}x the plan "
        f"(target <= {TARGET_S * 1000:.0f} ms: {verdict})"
    )
    new = statistics.median(news)
    verdict = "met" if new <= FIRST_TARGET_S else "MISSED"
    print(
        f"  a new server's first batch, median of {len(news)} servers: {new * 1000:.0f} ms = "
        f"{new / plan_s:.2f}x the plan (target <= {FIRST_TARGET_S * 1000:.0f} ms: {verdict}); "
        "each: " + " ".join(f"{s * 1000:.0f}" for s in news)
    )
    spread = max(cifar[1:]) / min(cifar[1:])
    verdict = "met" if spread <= SPREAD_TARGET else "MISSED"
    print(
        f"CIFAR-like {CIFAR_N:,} over shm, seconds per epoch: "
        + " ".join(f"{s:.3f}" for s in cifar)
        + f"\n  spread of epochs 1-5 (max/min): {spread:.2f} (target <= {SPREAD_TARGET}: {verdict})"
    )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "epochs",
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                "n_samples": n,
                "batch_size": BATCH,
                "first_batch_s": firsts,
                "later_median_s": later,
                "plan_s": plan_s,
                "later_vs_plan": later / plan_s,
                "new_server_first_batch_s": news,
                "new_server_median_s": new,
                "target": {
                    "later_first_batch_s": TARGET_S,
                    "met": later <= TARGET_S,
                    "new_server_first_batch_s": FIRST_TARGET_S,
                    "new_server_met": new <= FIRST_TARGET_S,
                    "cifar_spread": SPREAD_TARGET,
                    "cifar_spread_met": spread <= SPREAD_TARGET,
                },
                "cifar_epoch_s": cifar,
                "cifar_spread": spread,
                "load_before": load_before,
                "load_after": load_after,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
