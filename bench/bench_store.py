"""Store benchmark: ingest of per-sample ``.pt`` folders and random ``take`` from the store.

    python bench/bench_store.py [--quick] [--workdir DIR]

Generates a CIFAR-like folder (``uint8[3,32,32]`` + int label, one ``.pt`` per sample) and a
graph-like one (variable ``x[-1,8]``, ``edge_index[2,-1]``, scalar ``y``), then measures, in
one run on the same (page-cache warm) files:

* ingest files/s and MB/s vs. the raw ``torch.load`` rate of the same files with 2 threads
  (target: ratio >= 0.8);
* random 256-sample ``take`` from the store (mapped once, reused ``out`` buffers) vs.
  ``torch.load`` of 256 individual files + stack (the per-sample-file DataLoader's work);
* the same ``take`` vs. an in-memory numpy fancy-index gather (the floor).

Prints a table and writes JSON to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from shardserve.server.store.catalog import Store
from shardserve.server.store.ingest.run import ingest

BATCH = 256


def make_cifar_pt(folder: Path, n: int) -> list[Path]:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    files = []
    for i in range(n):
        img = torch.from_numpy(rng.integers(0, 256, (3, 32, 32), dtype=np.uint8))
        path = folder / f"{i:06d}.pt"
        torch.save({"image": img, "label": i % 10}, path)
        files.append(path)
    return files


def make_graph_pt(folder: Path, n: int) -> list[Path]:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    files = []
    for i in range(n):
        atoms, edges = int(rng.integers(5, 40)), int(rng.integers(4, 80))
        sample = {
            "x": torch.from_numpy(rng.standard_normal((atoms, 8), dtype=np.float32)),
            "edge_index": torch.from_numpy(rng.integers(0, atoms, (2, edges))),
            "y": float(i),
        }
        path = folder / f"{i:06d}.pt"
        torch.save(sample, path)
        files.append(path)
    return files


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")


def raw_load_rate(files: list[Path], threads: int = 2) -> float:
    """files/s of torch.load(weights_only=True) over ``files`` with a thread pool."""
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(_load, files):
            pass
    return len(files) / (time.perf_counter() - t)


def bench_ingest(kind: str, files: list[Path], store: Path, variable: list[str]) -> dict:
    src = files[0].parent
    nbytes = sum(f.stat().st_size for f in files)
    raw = raw_load_rate(files)
    summary = ingest(src, store, kind, variable=variable, threads=2, progress=False, overwrite=True)
    rate = len(files) / summary.seconds
    return {
        "files": len(files),
        "source_mb": nbytes / 1e6,
        "raw_torch_load_files_s": raw,
        "ingest_files_s": rate,
        "ingest_mb_s": nbytes / 1e6 / summary.seconds,
        "ratio_vs_raw": rate / raw,
        "shards": len(summary.manifest.shards),
    }


def bench_take(store: Store, files: list[Path], epochs: int) -> dict:
    ds = store.open("cifar")
    ds.verify()  # checksums off the clock, as a long-running server would have done
    n = ds.num_samples
    out = {"image": np.empty((BATCH, 3, 32, 32), np.uint8), "label": np.empty(BATCH, np.int64)}
    rng = np.random.default_rng(0)
    perms = [rng.permutation(n)[: n // BATCH * BATCH].reshape(-1, BATCH) for _ in range(epochs)]
    ds.take(perms[0][0], out=out)
    t = time.perf_counter()
    for perm in perms:
        for idx in perm:
            ds.take(idx, out=out)
    take_rate = epochs * perms[0].size / (time.perf_counter() - t)

    images = np.ascontiguousarray(ds.take(np.arange(n), fields=["image"])["image"])
    t = time.perf_counter()
    for perm in perms:
        for idx in perm:
            images.take(idx, axis=0, out=out["image"], mode="clip")
    floor = epochs * perms[0].size / (time.perf_counter() - t)

    nb = max(4, min(20, len(perms[0])))
    t = time.perf_counter()
    for idx in perms[0][:nb]:
        samples = [_load(files[i]) for i in idx]
        torch.stack([s["image"] for s in samples])
        torch.tensor([s["label"] for s in samples])
    pt_rate = nb * BATCH / (time.perf_counter() - t)
    return {
        "take_samples_s": take_rate,
        "numpy_floor_samples_s": floor,
        "torch_load_samples_s": pt_rate,
        "ratio_take_vs_torch_load": take_rate / pt_rate,
        "ratio_take_vs_floor": take_rate / floor,
    }


def bench_graph_take(store: Store, epochs: int) -> float:
    ds = store.open("graphs")
    ds.verify()
    n = ds.num_samples
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    count = 0
    for _ in range(epochs):
        for idx in rng.permutation(n)[: n // BATCH * BATCH].reshape(-1, BATCH):
            ds.take(idx)
            count += BATCH
    return count / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small datasets (about 30 s)")
    ap.add_argument(
        "--workdir", type=Path, default=None, help="where to generate data (default: a temp dir)"
    )
    args = ap.parse_args()
    n_cifar, n_graph, epochs = (4000, 1000, 3) if args.quick else (20000, 5000, 5)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        print(f"generating {n_cifar} cifar-like and {n_graph} graph-like .pt files in {work} ...")
        cifar_files = make_cifar_pt(work / "cifar_pt", n_cifar)
        graph_files = make_graph_pt(work / "graph_pt", n_graph)
        _load(cifar_files[0])  # import and warm torch.load off the clock
        store_root = work / "store"
        results = {
            "ingest_cifar": bench_ingest("cifar", cifar_files, store_root, []),
            "ingest_graphs": bench_ingest("graphs", graph_files, store_root, ["x", "edge_index"]),
        }
        store = Store(store_root)
        results["take_cifar"] = bench_take(store, cifar_files, epochs)
        results["take_graphs_samples_s"] = bench_graph_take(store, epochs)
        store.close()

    ic, ig, tc = results["ingest_cifar"], results["ingest_graphs"], results["take_cifar"]
    print(f"\n{'measure':<52} {'value':>14} {'ratio':>8}")
    for label, d in (("cifar", ic), ("graphs", ig)):
        print(
            f"{'ingest ' + label + ' files/s (' + str(d['files']) + ' files, 2 threads)':<52} "
            f"{d['ingest_files_s']:>14,.0f} {d['ratio_vs_raw']:>7.2f}x"
        )
        print(f"{'  raw torch.load files/s, 2 threads':<52} {d['raw_torch_load_files_s']:>14,.0f}")
        print(f"{'  ingest MB/s (source bytes)':<52} {d['ingest_mb_s']:>14,.1f}")
    print(f"{'take cifar 256-batches, samples/s (mmap, out=)':<52} {tc['take_samples_s']:>14,.0f}")
    print(
        f"{'  torch.load 256 files + stack, samples/s':<52} {tc['torch_load_samples_s']:>14,.0f} "
        f"{tc['ratio_take_vs_torch_load']:>7.1f}x"
    )
    print(
        f"{'  in-memory numpy gather (floor), samples/s':<52} {tc['numpy_floor_samples_s']:>14,.0f} "
        f"{tc['ratio_take_vs_floor']:>7.2f}x"
    )
    print(
        f"{'take graphs 256-batches (variable), samples/s':<52} {results['take_graphs_samples_s']:>14,.0f}"
    )

    out_dir = Path(__file__).resolve().parent / "results"
    out_dir.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    meta = {
        "date": stamp,
        "quick": args.quick,
        "machine": platform.platform(),
        "python": platform.python_version(),
    }
    path = out_dir / f"bench_store-{stamp}.json"
    path.write_text(json.dumps({**meta, **results}, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
