"""Memory an input can make the server hold: the bounds, each against itself turned off.

    python bench/bench_bounds.py [--quick]

Two workloads, each run twice in one process against a real ``shardserve serve`` on a
cifar-like dataset (20,000 samples of ~3 KiB, ~61 MB; ``--quick``: 5,000):

* **peers that never read**: 24 raw ZeroMQ peers say Hello with credit 64 on jobs of batch
  512 and never read. Run once with the default ``--unread-stream-bytes`` and
  ``--unread-bytes`` and once with both at 1 TiB (what the server did before they existed).
  Reported: the server's RSS growth (MB) and what it accounts unread
  (``shardserve_unread_bytes``); the ratio is bounded growth / unbounded growth.
* **quarantine floods**: a two-dataset mixture Loader reads one batch between posts of one
  quarantined id, N times (``same``), against N distinct ids (``distinct``). Reported: ms per
  post over the first and the last fifth, RSS growth and the ``held_bytes`` the server
  accounts; ``same`` should stay flat and hold one id.

RSS is noisy under load (the load average is printed); the tests assert the counted bounds.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import httpx
from _support import RawStream, make_cifar_like, make_job, run_server, zmq_context

from shardserve.client import Loader

ROOT = Path(__file__).resolve().parents[1]

PEERS = 24
UNBOUNDED = str(1 << 40)


def rss_mb(pid: int) -> float:
    """The process's resident set (``VmRSS``) in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " "))


def never_reading_peers(store: Path, *flags: str) -> tuple[float, float]:
    """RSS growth (MB) and accounted unread bytes (MB) with ``PEERS`` peers that never read."""
    with run_server(store, *flags) as srv, zmq_context() as ctx:
        jobs = [make_job(srv, batch_size=512, seed=i) for i in range(PEERS)]
        start = rss_mb(srv.proc.pid)
        peers = []
        for job in jobs:
            peer = RawStream(ctx, srv.tcp_endpoint)
            peer.hello(job, credit=64)
            peers.append(peer)
        time.sleep(6)  # let the server spend what it is allowed to; nothing reads
        grown = rss_mb(srv.proc.pid) - start
        held = _metric(srv.http_url, "shardserve_unread_bytes") / 1e6
        for peer in peers:
            peer.close()
        return grown, held


def quarantine_flood(store: Path, n: int, posts: int, same: bool) -> dict[str, float]:
    """Per-post time (first and last fifth), RSS growth and held bytes of ``posts`` posts."""
    with (
        run_server(store, "--state-dir", str(store / f"state-{same}")) as srv,
        Loader(
            srv.http_url,
            {"web": 1, "code": 1},
            batch_size=8,
            seed=0,
            epoch_samples=32 * n,
            timeout=120,
            prefetch=2,
        ) as loader,
    ):
        loader.set_epoch(0)
        it = iter(loader)
        next(it)
        start, took = rss_mb(srv.proc.pid), []
        for i in range(posts):
            next(it)  # the reader moves: each post takes effect at another step
            t0 = time.perf_counter()
            r = httpx.post(
                f"{srv.http_url}/v1/datasets/code/quarantine",
                timeout=600,
                json={"ids": [7 if same else 100 + i], "reason": "bench"},
            )
            took.append(time.perf_counter() - t0)
            r.raise_for_status()
        held = httpx.get(f"{srv.http_url}/v1/datasets/code/quarantine", timeout=30).json()
        k = max(posts // 5, 1)
        return {
            "first_ms": 1e3 * sum(took[:k]) / k,
            "last_ms": 1e3 * sum(took[-k:]) / k,
            "rss_growth_mb": rss_mb(srv.proc.pid) - start,
            "total_ids": held["total_ids"],
            "held_bytes": held["held_bytes"],
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5,000 samples, 100 posts")
    args = ap.parse_args(argv)
    n, posts = (5_000, 100) if args.quick else (20_000, 500)
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="bench-bounds-") as tmp:
        store = Path(tmp)
        make_cifar_like(store, "cifar", n=n, shard_bytes=4 << 20)
        make_cifar_like(store, "web", n=n, seed=0)
        make_cifar_like(store, "code", n=n, seed=1)
        bounded = never_reading_peers(store)
        unbounded = never_reading_peers(
            store, "--unread-stream-bytes", UNBOUNDED, "--unread-bytes", UNBOUNDED
        )
        print(
            f"{PEERS} peers that never read: RSS +{bounded[0]:.0f} MB bounded "
            f"({bounded[1]:.0f} MB accounted unread) vs +{unbounded[0]:.0f} MB unbounded: "
            f"{bounded[0] / max(unbounded[0], 1e-9):.2f}x"
        )
        for same in (True, False):
            q = quarantine_flood(store, n, posts, same)
            print(
                f"quarantine, {posts} posts of {'one id' if same else 'distinct ids'}: "
                f"{q['first_ms']:.1f} -> {q['last_ms']:.1f} ms/post "
                f"({q['last_ms'] / q['first_ms']:.2f}x), RSS +{q['rss_growth_mb']:.0f} MB, "
                f"{q['total_ids']} ids, {q['held_bytes']} bytes held"
            )
    print(f"load average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
