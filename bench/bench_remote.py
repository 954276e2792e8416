"""Remote stores and Ray ingest: epoch throughput from an S3-served store, as ratios of the local
store's in the same run, and ``--engine ray`` ingest time against local ingest.

    python bench/bench_remote.py [--quick] [--n N]

The S3 server is moto's (``ThreadedMotoServer`` on loopback, in this process) and the client
is pyarrow's real S3 client inside the server, so the "remote" costs are the HTTP wire, moto's
Python object store and the cache's fetch + checksum + publish. One ``Loader`` (rank 0 of 1,
``shuffle="block"``, batch 256, shared-memory transport) reads whole epochs; rows:

* ``local``: the store folder served directly (second epoch: page cache warm);
* ``s3 cold``: a fresh cache as large as the dataset, first epoch (every shard fetched);
* ``s3 warm``: the same server's second epoch (every shard a cache hit);
* ``s3 half cache``: a fresh cache half the dataset's size, second epoch (steady state:
  evictions, refetches, prefetch of the plan's next shards);
* ingest: ``shardserve ingest`` of the same samples as ``.npz`` files, local engine vs
  ``--engine ray --ray-cpus 2`` (wall time of the command, Ray's start-up included), when
  Ray is installed.

Writes ``bench/results/remote.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from shardserve.client import Loader, serve_local
from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.remote.publish import RemotePublisher
from shardserve.server.store.remote.stores import RemoteStore, StoreOptions
from shardserve.server.store.write.writer import ShardWriter

RESULTS = Path(__file__).resolve().parent / "results" / "remote.json"
FIELDS = (
    FieldSpec(name="image", dtype="uint8", shape=(3, 32, 32)),
    FieldSpec(name="label", dtype="int64", shape=()),
)
BATCH = 256


def make_data(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8), np.arange(n) % 10


def epoch(url: str, e: int) -> float:
    """Samples/s of epoch ``e`` for rank 0 of 1, touching every batch."""
    with Loader(url, "cifar", BATCH, seed=0, shuffle="block", rank=0, world_size=1) as ld:
        ld.set_epoch(e)
        t0 = time.perf_counter()
        n = 0
        for b in ld:
            n += int(b["label"].shape[0])
            b["image"].sum()  # touch the batch
        return n / (time.perf_counter() - t0)


def run_cli(*args: str) -> float:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "shardserve.server", "ingest", *args, "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if r.returncode:
        raise SystemExit(f"ingest failed: {r.stderr[-2000:]}")
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10,000 samples instead of 50,000")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--shard-mib", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="interleaved steady-state epochs")
    args = p.parse_args()
    n = args.n or (10_000 if args.quick else 50_000)
    from moto.server import ThreadedMotoServer

    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench-secret",
        AWS_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    results: dict[str, object] = {}
    try:
        import pyarrow.fs as pafs

        pafs.S3FileSystem(
            endpoint_override=f"{host}:{port}", scheme="http", allow_bucket_creation=True
        ).create_dir("bench")
        images, labels = make_data(n)
        root = work / "store"
        with ShardWriter(root, "cifar", fields=FIELDS, shard_bytes=args.shard_mib << 20) as w:
            w.add_batch({"image": images, "label": labels})
        m = w.manifest
        assert m is not None
        uri = "s3://bench/store"
        t0 = time.perf_counter()
        RemotePublisher(RemoteStore(uri, StoreOptions.from_env(os.environ))).upload(
            root / "cifar", "cifar", overwrite=False
        )
        upload_s = time.perf_counter() - t0
        print(
            f"{n} samples, {len(m.shards)} shards, {m.total_bytes / 1e6:.0f} MB; "
            f"upload {upload_s:.1f} s"
        )

        # The three servers run side by side and their steady-state epochs are interleaved
        # round by round, so the noise of a shared machine falls on every row alike; each
        # row is its best round. A cold cache has only its first epoch.
        half = m.total_bytes // 2
        with (
            serve_local(root) as local_url,
            serve_local(uri, "--cache-dir", str(work / "c1")) as warm_url,
            serve_local(
                uri, "--cache-dir", str(work / "c2"), "--cache-limit-bytes", str(half)
            ) as half_url,
        ):
            cold = epoch(warm_url, 0)
            epoch(local_url, 0)
            epoch(half_url, 0)
            best = {"local": 0.0, "warm": 0.0, "half": 0.0}
            for r in range(1, 1 + args.rounds):
                for k, url in (("local", local_url), ("warm", warm_url), ("half", half_url)):
                    best[k] = max(best[k], epoch(url, r))
            local, warm, halfc = best["local"], best["warm"], best["half"]
        rows = {"local": local, "s3 cold": cold, "s3 warm": warm, "s3 half cache": halfc}
        print(f"\n{'epoch (block shuffle)':<24}{'samples/s':>12}{'x local':>10}")
        for k, v in rows.items():
            print(f"{k:<24}{v:>12,.0f}{v / local:>10.2f}")
        results["epoch_samples_per_s"] = rows
        results["ratio_to_local"] = {k: v / local for k, v in rows.items()}

        src = work / "src"
        src.mkdir()
        for i, start in enumerate(range(0, n, max(1, n // 16))):
            stop = min(n, start + max(1, n // 16))
            np.savez(src / f"part-{i:03d}.npz", image=images[start:stop], label=labels[start:stop])
        out = work / "ingest"
        t_local = run_cli(str(src), "--store", str(out), "--name", "loc", "--shard-size", "8MiB")
        ingest: dict[str, float] = {"local_s": t_local}
        try:
            import ray  # noqa: F401

            t_ray = run_cli(
                str(src),
                "--store",
                str(out),
                "--name",
                "ray",
                "--shard-size",
                "8MiB",
                "--engine",
                "ray",
                "--ray-cpus",
                "2",
            )
            ingest["ray_s"] = t_ray
            ingest["ray_over_local"] = t_ray / t_local
            print(
                f"\ningest {n} samples: local {t_local:.1f} s, ray (2 CPUs) {t_ray:.1f} s "
                f"({t_ray / t_local:.2f}x local; Ray start-up included)"
            )
        except ImportError:
            print(f"\ningest {n} samples: local {t_local:.1f} s; ray not installed")
        results["ingest"] = ingest
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    results.update(
        n=n,
        shards=len(m.shards),
        bytes=m.total_bytes,
        upload_s=upload_s,
        host=platform.node(),
        cpus=os.cpu_count(),
        when=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
