"""shardserve next to the loaders its users would otherwise pick, on the same CIFAR-like data.

    python bench/bench_peers.py [--quick] [--workdir DIR]

The comparison users of those libraries ask for first: N CIFAR-like samples of the same
shape (``image`` uint8 ``[3, 32, 32]``, ``label`` int64; random bytes, written by each
library's own writer), shuffled, batch 256, read by

* **shardserve**: ``Loader`` over shared memory from a local server (the store written by
  ``ShardWriter``);
* **HF datasets**: ``save_to_disk`` then ``load_from_disk(...).with_format("torch")`` in a
  ``DataLoader(shuffle=True)`` with 0 and 2 workers (its documented PyTorch path);
* **LitData**: ``litdata.optimize()`` then ``StreamingDataset(shuffle=True)`` in a
  ``StreamingDataLoader`` with 0 and 2 workers;
* **MosaicML Streaming** (MDS): ``MDSWriter`` then ``StreamingDataset(shuffle=True)`` in a
  ``DataLoader`` with 0 and 2 workers, run with the Python of ``.venv-mds`` (Streaming pins
  ``numpy<2.2``, which the other rows' environment does not allow; ``.ci/run`` builds it, or
  set ``SHARDSERVE_MDS_PYTHON``).

A peer whose library is not installed is skipped with one line (``pip install
'shardserve[bench-peers]'`` brings HF datasets and LitData). For each row: epoch 0 warms the
page cache and the workers' imports, epoch 1 is measured: samples/s over the whole epoch,
and its first batch (from asking for the epoch's iterator to holding a batch: what a
training loop waits at every epoch start, worker start-up included). One run, ratios
within it; the load average is printed. Writes ``bench/results/peers.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _ingest_sources import MDS_PYTHON
from _small_data import make_cifar
from torch.utils.data import DataLoader

from shardserve.client import Loader, serve_local

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results" / "peers.json"
BATCH = 256
WORKERS = (0, 2)
Epoch = Callable[[int], Iterable[Any]]


def measure(epoch: Epoch, n: int) -> dict[str, float]:
    """Epoch 0 warms up; epoch 1: samples/s, and seconds to its first batch."""
    for _ in epoch(0):
        pass
    t0 = time.perf_counter()
    first = float("nan")
    seen = 0
    for b in epoch(1):
        if seen == 0:
            first = time.perf_counter() - t0
        seen += len(b["label"])
    wall = time.perf_counter() - t0
    if seen < n - BATCH * 2:  # a loader that lost samples would look fast
        raise AssertionError(f"an epoch of {n} samples gave {seen}")
    return {"samples_s": seen / wall, "first_batch_s": first, "epoch_s": wall}


def shardserve_row(url: str, n: int) -> dict[str, float]:
    with Loader(url, "cifar", BATCH, seed=0, rank=0, world_size=1) as ld:

        def epoch(e: int) -> Iterable[Any]:
            ld.set_epoch(e)
            return ld

        return measure(epoch, n)


def hf_rows(work: Path, arrays: dict[str, np.ndarray], n: int) -> dict[str, dict[str, float]]:
    import datasets as hf

    d = work / "hf"
    features = hf.Features({"image": hf.Array3D((3, 32, 32), "uint8"), "label": hf.Value("int64")})
    hf.Dataset.from_dict(
        {"image": arrays["image"], "label": arrays["label"]}, features=features
    ).save_to_disk(str(d))
    ds = hf.load_from_disk(str(d)).with_format("torch")
    rows = {}
    for w in WORKERS:
        dl = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=w)
        rows[f"HF datasets, torch format + DataLoader, workers {w}"] = measure(
            _epochs(dl, lambda e: None),
            n,  # shuffle=True draws a new order per iter()
        )
    return rows


def _litdata_sample(i: int) -> dict[str, Any]:
    # Made from its index: optimize()'s worker process does not see this one's arrays.
    rng = np.random.default_rng(i)
    return {"image": rng.integers(0, 256, (3, 32, 32), dtype=np.uint8), "label": i % 10}


def litdata_rows(work: Path, n: int) -> dict[str, dict[str, float]]:
    import litdata

    d = work / "litdata"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LitData's own notes
        litdata.optimize(
            fn=_litdata_sample,
            inputs=list(range(n)),
            output_dir=str(d),
            chunk_bytes="64MB",
            num_workers=1,
        )
    rows = {}
    for w in WORKERS:
        ds = litdata.StreamingDataset(str(d), shuffle=True, seed=0)
        dl = litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=w)
        rows[f"LitData StreamingDataLoader, workers {w}"] = measure(
            _epochs(dl, lambda e, ds=ds: ds.set_epoch(e + 1)), n
        )
    return rows


def mds_rows(work: Path, n: int) -> dict[str, dict[str, float]]:
    d = work / "mds"
    side = Path(__file__).with_name("mds_side.py")

    def run(*args: str) -> str:
        out = subprocess.run(
            [str(MDS_PYTHON), str(side), *args],
            check=True,
            text=True,
            capture_output=True,
            timeout=1800,
        )
        return out.stdout

    run("write", str(d), str(n))
    rows = {}
    for w in WORKERS:
        got = json.loads(run("load", str(d), str(w), str(BATCH)).strip().splitlines()[-1])
        if got["samples"] < n - BATCH * 2:
            raise AssertionError(f"MDS: an epoch of {n} samples gave {got['samples']}")
        rows[f"MosaicML Streaming (MDS) + DataLoader, workers {w}"] = got["row"]
    return rows


def _epochs(dl: Iterable[Any], set_epoch: Callable[[int], None]) -> Epoch:
    def epoch(e: int) -> Iterable[Any]:
        set_epoch(e)
        return dl

    return epoch


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="8,000 samples instead of 50,000")
    p.add_argument("--workdir", type=Path, default=None, help="where to write the data")
    args = p.parse_args()
    torch.set_num_threads(1)
    n = 8_000 if args.quick else 50_000
    res: dict[str, Any] = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} cpus={os.cpu_count()}",
        "torch": torch.__version__,
        "quick": args.quick,
        "samples": n,
        "batch": BATCH,
        "load_before": os.getloadavg(),
        "rows": {},
        "skipped": [],
    }
    rows: dict[str, dict[str, float]] = res["rows"]
    with tempfile.TemporaryDirectory(prefix="ss-bench-peers-", dir=args.workdir) as tmp:
        work = Path(tmp)
        print(f"writing {n:,} CIFAR-like samples for each loader ...", flush=True)
        arrays = make_cifar(work / "store", n)
        with serve_local(work / "store") as url:
            rows["shardserve Loader (shared memory)"] = shardserve_row(url, n)
        peers: dict[str, Callable[[], dict[str, dict[str, float]]]] = {
            "datasets": lambda: hf_rows(work, arrays, n),
            "litdata": lambda: litdata_rows(work, n),
        }
        for module, run in peers.items():
            try:
                __import__(module)
            except ImportError:
                line = f"{module}: not installed (pip install 'shardserve[bench-peers]'), skipped"
                print(line, flush=True)
                res["skipped"].append(line)
                continue
            print(f"{module} ...", flush=True)
            rows.update(run())
        if MDS_PYTHON.exists():
            print("mosaicml-streaming ...", flush=True)
            rows.update(mds_rows(work, n))
        else:
            line = f"MosaicML Streaming: no environment at {MDS_PYTHON} (see .ci/run), skipped"
            print(line, flush=True)
            res["skipped"].append(line)
    res["load_after"] = os.getloadavg()
    ours = rows["shardserve Loader (shared memory)"]
    print(f"\n{'loader':56}{'samples/s':>12}{'first batch':>13}{'shardserve is':>15}")
    for label, r in rows.items():
        r["shardserve_x"] = ours["samples_s"] / r["samples_s"]
        print(
            f"{label:56}{r['samples_s']:>12,.0f}{r['first_batch_s'] * 1e3:>10.1f} ms"
            f"{r['shardserve_x']:>14.1f}x"
        )
    print(
        f"\nload average before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f} "
        f"({os.cpu_count()} cpus)"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
