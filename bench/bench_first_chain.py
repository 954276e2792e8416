"""The first batch of a new server's first job at 40M records, with a transform chain.

    python bench/bench_first_chain.py [--n 40000000] [--servers 5] [--baseline DIR] [--workdir DIR]

A dataset of ``n`` samples of ``uint8[1,2,2]`` (160 MB at 40M: the plan is the work), one
``hflip`` step on the server, global shuffle, batch 256, rank 0 of world size 8 (its plan
deals 40M positions to 8 ranks). On each of ``--servers`` new servers: seconds from
``Loader(...)`` (the job is created, so the dataset is first opened and pyarrow imported
then) to its first batch, split into the ``Loader(...)`` call and ``iter()`` -> batch;
medians. ``--baseline DIR``: a folder holding ``shardserve/{server,client,proto}`` of another
checkout; its servers run first (``PYTHONPATH``), the ratio is this code's median over its.
Target: <= 2 s. Writes ``bench/results/first_chain.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from _support import run_server

from shardserve.client import Loader
from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.write.writer import ShardWriter

RESULTS = Path(__file__).resolve().parent / "results" / "first_chain.json"
TARGET_S = 2.0
CHAIN = [{"name": "hflip", "params": {"field": "x", "layout": "CHW"}}]
WORLD = {"WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0"}


def make_store(root: Path, n: int) -> Path:
    store = root / f"store-pix-{n}"
    if (store / "pix").exists():
        return store
    fields = [FieldSpec(name="x", dtype="uint8", shape=(1, 2, 2))]
    block = (np.arange(4 << 20, dtype=np.uint32) % 251).astype(np.uint8).reshape(-1, 1, 2, 2)
    with ShardWriter(store, "pix", fields=fields, shard_bytes=64 << 20) as w:
        for s in range(0, n, 1 << 20):
            w.add_batch({"x": block[: min(n, s + (1 << 20)) - s]})
    return store


def firsts(store: Path, k: int, env: dict[str, str]) -> list[tuple[float, float]]:
    """``(Loader() s, iter() -> first batch s)`` on each of ``k`` new servers."""
    out = []
    saved = {key: os.environ.get(key) for key in WORLD}
    os.environ.update(WORLD)  # the Loader reads its rank as a DDP launcher sets it
    try:
        for i in range(k):
            with run_server(store, env=env, timeout=120) as srv:
                t0 = time.perf_counter()
                ld = Loader(srv.http_url, "pix", 256, seed=100 + i, transforms=CHAIN, timeout=120)
                t1 = time.perf_counter()
                next(iter(ld))
                out.append((t1 - t0, time.perf_counter() - t1))
                ld.close()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=40_000_000)
    p.add_argument("--servers", type=int, default=5, help="new servers per code (median)")
    p.add_argument("--baseline", type=Path, default=None, help="another checkout's packages")
    p.add_argument("--workdir", type=Path, default=None, help="keep the data here")
    args = p.parse_args()
    res: dict = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "n": args.n,
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "target_s": TARGET_S,
        "rows": {},
    }
    codes: dict[str, dict[str, str]] = {"this": {}}
    if args.baseline is not None:
        codes = {"baseline": {"PYTHONPATH": str(args.baseline)}, **codes}
    with tempfile.TemporaryDirectory(prefix="ss-first-") as tmp:
        store = make_store(args.workdir or Path(tmp), args.n)
        for code, env in codes.items():
            got = firsts(store, args.servers, env)
            total = statistics.median(a + b for a, b in got)
            res["rows"][code] = {
                "first_batch_s": round(total, 3),
                "loader_s": round(statistics.median(a for a, _ in got), 3),
                "iter_to_batch_s": round(statistics.median(b for _, b in got), 3),
                "each_s": [round(a + b, 3) for a, b in got],
            }
            print(
                f"{code:8} first batch, median of {args.servers} new servers: {total:.3f} s "
                f"(Loader() {res['rows'][code]['loader_s']:.3f} s, iter -> batch "
                f"{res['rows'][code]['iter_to_batch_s']:.3f} s); target <= {TARGET_S:.0f} s: "
                f"{'met' if total <= TARGET_S else 'MISSED'}",
                flush=True,
            )
    if "baseline" in res["rows"]:
        ratio = res["rows"]["this"]["first_batch_s"] / res["rows"]["baseline"]["first_batch_s"]
        res["this_over_baseline"] = round(ratio, 3)
        print(f"this / baseline: {ratio:.2f}")
    res["load_after"] = os.getloadavg()
    print(f"load average before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
