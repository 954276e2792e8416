"""End-to-end benchmark: samples/s delivered to a training loop, shardserve vs. torch DataLoader.

    python bench/bench_e2e.py [--quick] [--workdir DIR]

Three datasets, shuffled: CIFAR-like (``uint8[3,32,32]`` + int64 label, N=50,000, batch 256),
64 KiB samples (``float32[64,256]`` + label, N=20,000, batch 256) and 1 MiB samples
(``float32[256,1024]`` + label, N=1,024, batch 16). One run measures, for each:

* ``floor``: an in-process ``np.take`` gather from in-memory arrays (the least CPU work
  that produces a shuffled batch);
* ``Arrow mmap take``: the store's own vectorised ``take`` in this process, mapped once,
  into reused buffers (what a server cannot beat; the target is >= 0.5x of it);
* ``memcpy``: a single-thread copy of the same bytes per batch (the GB/s ceiling);
* ``shardserve shm`` / ``ipc`` / ``tcp``: ``Loader`` against a ``serve_local`` server, with
  the client's CPU seconds per batch and the server's CPU seconds per delivered GB;
* CIFAR only, with ``--tf-python`` (an interpreter with ``tensorflow-cpu``, e.g. a separate
  virtualenv): tf.data local and tf.data service on the same samples (``bench_tfdata.py``);
* CIFAR and 64 KiB only: ``DataLoader`` over an in-memory ``TensorDataset``, one ``.pt``
  file per sample, and chunked ``.pt`` files (1,000 samples each), each with ``num_workers``
  0 and 2; time to first batch from ``Loader`` construction with a running server (new job
  each time); the server's RSS while 1 and then 4 jobs read the same dataset (the page
  cache is shared, RSS should not grow).

Each configuration runs two epochs; the second (steady state, persistent workers) is
reported. The loop touches every tensor of every batch. Prints a table of samples/s, GB/s
and ratios, and each target of the performance issue that applies, met or missed; writes
``bench/results/e2e.json``. ``--quick``: N/8 (at least 16 batches), under 2 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from _loops import server_pid  # this folder is on the path of a script here
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, get_worker_info

from shardserve.client import Loader, serve_local
from shardserve.server.store.catalog import Store

CHUNK = 1000
#: ``full``: every baseline (DataLoader configurations, time to first batch, RSS); the 1 MiB
#: case measures only the transports against memcpy (its .pt copies would take gigabytes).
CASES = {
    "cifar": {"n": 50_000, "image": ((3, 32, 32), np.uint8), "batch": 256, "full": True},
    "64k": {"n": 20_000, "image": ((64, 256), np.float32), "batch": 256, "full": True},
    "1m": {"n": 1_024, "image": ((256, 1024), np.float32), "batch": 16, "full": False},
}
RESULTS = Path(__file__).resolve().parent / "results" / "e2e.json"


def make_arrays(case: str, n: int) -> dict[str, np.ndarray]:
    shape, dtype = CASES[case]["image"]  # type: ignore[misc]
    rng = np.random.default_rng(0)
    if dtype == np.uint8:
        image = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    else:
        image = rng.standard_normal((n, *shape), dtype=np.float32)
    return {"image": image, "label": np.arange(n, dtype=np.int64) % 10}


def write_files(
    arrays: dict[str, np.ndarray], root: Path, name: str, pt_files: bool = True
) -> None:
    """The same samples as a shardserve dataset and (``pt_files``) one .pt per sample and
    chunked .pt files."""
    n = len(arrays["label"])
    np.savez(root / f"{name}.npz", **arrays)
    cmd = [
        sys.executable,
        "-m",
        "shardserve.server",
        "ingest",
        str(root / f"{name}.npz"),
        "--store",
        str(root / "store"),
        "--name",
        name,
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    (root / f"{name}.npz").unlink()
    if not pt_files:
        return
    per, chunks = root / f"{name}-per-sample", root / f"{name}-chunks"
    per.mkdir(parents=True)
    chunks.mkdir()
    image, label = torch.from_numpy(arrays["image"]), torch.from_numpy(arrays["label"])
    for i in range(n):
        torch.save({"image": image[i].clone(), "label": label[i].clone()}, per / f"{i:06d}.pt")
    for c in range(0, n, CHUNK):
        torch.save(
            {"image": image[c : c + CHUNK].clone(), "label": label[c : c + CHUNK].clone()},
            chunks / f"{c // CHUNK:05d}.pt",
        )


class PerSampleFiles(Dataset):
    def __init__(self, folder: Path) -> None:
        self.files = sorted(folder.glob("*.pt"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return torch.load(self.files[i], weights_only=True)


class ChunkedFiles(IterableDataset):
    """Shuffled chunk order, shuffled within a chunk; workers split the chunks."""

    def __init__(self, folder: Path) -> None:
        self.files = sorted(folder.glob("*.pt"))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        files = self.files[info.id :: info.num_workers] if info else self.files
        rng = np.random.default_rng()
        for f in rng.permutation(len(files)):
            chunk = torch.load(files[f], weights_only=True)
            for i in rng.permutation(len(chunk["label"])):
                yield {k: v[i] for k, v in chunk.items()}


def touch(batch: dict[str, torch.Tensor]) -> float:
    # Reads one element of every tensor: the batch must exist, the loop adds no real work.
    return sum(float(t.reshape(-1)[-1]) for t in batch.values())


def run_epochs(
    epoch_iter: Callable[[int], Iterable[dict[str, torch.Tensor]]], n: int, batch: int
) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in range(2):
        t0 = time.perf_counter()
        first = None
        count = 0
        for b in epoch_iter(e):
            if first is None:
                first = time.perf_counter() - t0
            touch(b)
            count += len(b["label"])
        dt = time.perf_counter() - t0
        assert count >= n - batch, f"epoch delivered {count} of {n} samples"
        out[f"epoch{e}_s"], out[f"first_batch_epoch{e}_s"] = dt, first or 0.0
    out["samples_s"] = n / out["epoch1_s"]
    return out


def floor(
    arrays: dict[str, np.ndarray], batch: int
) -> Callable[[int], Iterable[dict[str, torch.Tensor]]]:
    n = len(arrays["label"])

    def epoch(e: int) -> Iterator[dict[str, torch.Tensor]]:
        # np.take copies whole rows with memcpy: the fastest single-thread gather we found
        # (torch index_select and default_collate's stack are slower for 64 KiB rows).
        perm = np.random.default_rng(e).permutation(n)
        for i in range(0, n, batch):
            idx = perm[i : i + batch]
            yield {k: torch.from_numpy(np.take(v, idx, axis=0)) for k, v in arrays.items()}

    return epoch


def arrow_take(
    store: Path, name: str, n: int, batch: int
) -> Callable[[int], Iterable[dict[str, torch.Tensor]]]:
    ds = Store(store).open(name)
    out = {
        k: np.empty((batch, *shape[1]), dtype=shape[0]) for k, shape in ds.part_shapes(None).items()
    }

    def epoch(e: int) -> Iterator[dict[str, torch.Tensor]]:
        perm = np.random.default_rng(e).permutation(n)
        for i in range(0, n, batch):
            idx = perm[i : i + batch]
            views = {k: v[: len(idx)] for k, v in out.items()}
            yield {k: torch.from_numpy(a) for k, a in ds.take(idx, None, out=views).items()}

    return epoch


def memcpy(
    arrays: dict[str, np.ndarray], batch: int
) -> Callable[[int], Iterable[dict[str, torch.Tensor]]]:
    n = len(arrays["label"])
    dst = {k: np.empty((batch, *v.shape[1:]), v.dtype) for k, v in arrays.items()}

    def epoch(e: int) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(0, n, batch):
            m = min(batch, n - i)
            for k, v in arrays.items():
                np.copyto(dst[k][:m], v[i : i + m])
            yield {k: torch.from_numpy(d[:m]) for k, d in dst.items()}

    return epoch


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime in clock ticks


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def rss_jobs(url: str, name: str, pid: int, batch: int) -> dict[str, float]:
    """Server RSS after an epoch with 1 job, then with 4 more jobs of the same dataset."""

    def epoch(seed: int) -> None:
        with Loader(url, name, batch, seed=seed, rank=0, world_size=1) as loader:
            for _ in loader:
                pass

    epoch(500)
    time.sleep(1.0)  # let the server handle the Bye and drop that stream's buffers
    one = rss_mb(pid)
    loaders = [Loader(url, name, batch, seed=600 + j, rank=0, world_size=1) for j in range(4)]
    its = [iter(x) for x in loaders]
    live = list(its)
    while live:
        live = [it for it in live if next(it, None) is not None]
    for x in loaders:
        x.close()
    time.sleep(1.0)
    return {"rss_1_job_mb": one, "rss_4_jobs_mb": rss_mb(pid)}


def dataloader(
    ds: Dataset, workers: int, batch: int
) -> Callable[[int], Iterable[dict[str, torch.Tensor]]]:
    shuffle = not isinstance(ds, IterableDataset)
    dl = DataLoader(
        ds, batch_size=batch, shuffle=shuffle, num_workers=workers, persistent_workers=workers > 0
    )
    return lambda e: dl


def time_to_first_batch(url: str, name: str, batch: int, repeats: int = 5) -> dict[str, float]:
    """Loader construction -> first batch, with a new job (seed) each time."""
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        with Loader(url, name, batch, seed=1000 + r, rank=0, world_size=1) as loader:
            next(iter(loader))
            times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def tf_data(tf_python: str, n: int, batch: int, work: Path) -> dict[str, dict[str, float]]:
    """tf.data local and tf.data service rows from ``bench_tfdata.py`` run by an interpreter
    that has TensorFlow (same samples: ``make_arrays("cifar", n)``)."""
    out = work / "tfdata.json"
    cmd = [
        tf_python,
        str(Path(__file__).with_name("bench_tfdata.py")),
        "--n",
        str(n),
        "--batch",
        str(batch),
        "--json",
        str(out),
    ]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"  tf.data: not measured ({e})", flush=True)
        return {}
    rows = json.loads(out.read_text())["rows"]
    result = {}
    for label, r in rows.items():
        result[label] = {
            "samples_s": r["samples_s"],
            "first_batch_epoch1_s": r["first_batch_s"][-1],
        }
        print(f"  {label:32} {r['samples_s']:>12,.0f} samples/s", flush=True)
    return result


def bench_case(case: str, n: int, work: Path, tf_python: str | None = None) -> dict[str, object]:
    cfg = CASES[case]
    batch, full = int(cfg["batch"]), bool(cfg["full"])  # type: ignore[call-overload]
    print(f"\n[{case}] N={n}, batch {batch}: writing files and ingesting ...", flush=True)
    arrays = make_arrays(case, n)
    write_files(arrays, work, case, pt_files=full)
    rows: dict[str, dict[str, float]] = {}

    def record(label: str, fn: Callable[[int], Iterable[dict[str, torch.Tensor]]]) -> None:
        rows[label] = run_epochs(fn, n, batch)
        print(f"  {label:32} {rows[label]['samples_s']:>12,.0f} samples/s", flush=True)

    record("floor (in-process gather)", floor(arrays, batch))
    record("memcpy (same bytes)", memcpy(arrays, batch))
    record("Arrow mmap take (in process)", arrow_take(work / "store", case, n, batch))
    nbytes = sum(v.nbytes for v in arrays.values())
    ttfb: dict[str, float] = {}
    rss: dict[str, float] = {}
    with serve_local(work / "store") as url:
        pid = server_pid(work / "store")
        for label, transport in (("shm", "auto"), ("ipc", "ipc"), ("tcp", "tcp")):
            with Loader(
                url, case, batch, seed=0, rank=0, world_size=1, transport=transport
            ) as loader:

                def epochs(e: int, loader: Loader = loader) -> Iterable[dict[str, torch.Tensor]]:
                    loader.set_epoch(e)
                    return loader  # type: ignore[return-value]

                c0, s0 = time.process_time(), cpu_s(pid) if pid else 0.0
                record(f"shardserve {label}", epochs)
                row = rows[f"shardserve {label}"]
                row["stall_fraction"] = loader.stats().stall_fraction
                row["transport"] = loader.stats().transport  # type: ignore[assignment]
                batches = 2 * -(-n // batch)
                row["client_cpu_us_per_batch"] = (time.process_time() - c0) / batches * 1e6
                if pid:
                    row["server_cpu_s_per_gb"] = (cpu_s(pid) - s0) / (2 * nbytes / 1e9)
        if full:
            ttfb = time_to_first_batch(url, case, batch)
            rss = rss_jobs(url, case, pid, batch) if pid else {}
            rss["dataset_mb"] = (
                sum(p.stat().st_size for p in (work / "store" / case).rglob("*.arrow")) / 2**20
            )
    if full:
        tensors = TensorDataset(
            torch.from_numpy(arrays["image"]), torch.from_numpy(arrays["label"])
        )

        class Dicts(Dataset):
            def __len__(self) -> int:
                return n

            def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
                x, y = tensors[i]
                return {"image": x, "label": y}

        for workers in (0, 2):
            record(f"DataLoader TensorDataset w={workers}", dataloader(Dicts(), workers, batch))
            record(
                f"DataLoader .pt per sample w={workers}",
                dataloader(PerSampleFiles(work / f"{case}-per-sample"), workers, batch),
            )
            record(
                f"DataLoader chunked .pt w={workers}",
                dataloader(ChunkedFiles(work / f"{case}-chunks"), workers, batch),
            )
        if tf_python and case == "cifar":
            rows.update(tf_data(tf_python, n, batch, work))
    fl = rows["floor (in-process gather)"]["samples_s"]
    ours = rows["shardserve shm"]["samples_s"]
    per_sample = nbytes / n
    for r in rows.values():
        r["vs_floor"] = r["samples_s"] / fl
        r["shardserve_speedup"] = ours / r["samples_s"]
        r["gb_s"] = r["samples_s"] * per_sample / 1e9
    return {
        "n": n,
        "batch": batch,
        "rows": rows,
        "time_to_first_batch": ttfb,
        "rss": rss,
        "targets": targets(case, rows, ttfb, rss),
    }


def targets(
    case: str, rows: dict[str, dict[str, float]], ttfb: dict[str, float], rss: dict[str, float]
) -> list[dict[str, object]]:
    """The issue's targets that apply to ``case``: name, measured value, goal, met or not."""
    ours = rows["shardserve shm"]["samples_s"]
    out: list[dict[str, object]] = []

    def add(name: str, value: float, goal: float, higher: bool = True) -> None:
        out.append(
            {
                "target": name,
                "value": value,
                "goal": goal,
                "op": ">=" if higher else "<=",
                "met": value >= goal if higher else value <= goal,
            }
        )

    if case == "cifar":
        add(
            "shm vs DataLoader .pt per sample w=2",
            ours / rows["DataLoader .pt per sample w=2"]["samples_s"],
            30,
        )
        add(
            "shm vs DataLoader TensorDataset w=0",
            ours / rows["DataLoader TensorDataset w=0"]["samples_s"],
            2,
        )
        add(
            "shm vs Arrow mmap take in process",
            ours / rows["Arrow mmap take (in process)"]["samples_s"],
            0.5,
        )
        if "tf.data service" in rows:
            add("shm vs tf.data service", ours / rows["tf.data service"]["samples_s"], 15)
    if case == "64k":
        add(
            "shm vs single-thread memcpy (GB/s)",
            ours / rows["memcpy (same bytes)"]["samples_s"],
            0.5,
        )
    if ttfb:
        add("time to first batch, ms", ttfb["median_s"] * 1000, 50, higher=False)
    if rss:
        growth = (rss.get("rss_4_jobs_mb", 0) - rss.get("rss_1_job_mb", 0)) / rss["dataset_mb"]
        add("RSS growth 4 jobs vs 1, fraction of dataset", growth, 0.1, higher=False)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="N/8 per case, under ~2 minutes")
    p.add_argument(
        "--workdir", type=Path, default=None, help="where to write the data (default: a temp dir)"
    )
    p.add_argument(
        "--tf-python",
        default=os.environ.get("SHARDSERVE_BENCH_TF_PYTHON"),
        help="a Python with tensorflow-cpu, for the tf.data rows (default: "
        "$SHARDSERVE_BENCH_TF_PYTHON; without it they are skipped)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    results: dict[str, object] = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} cores={torch.get_num_threads()}/{os.cpu_count()}",
        "torch": torch.__version__,
        "quick": args.quick,
        "cases": {},
    }
    with tempfile.TemporaryDirectory(prefix="ss-bench-e2e-", dir=args.workdir) as tmp:
        for case, cfg in CASES.items():
            n = int(cfg["n"]) // (8 if args.quick else 1)  # type: ignore[call-overload]
            n = max(n, 16 * int(cfg["batch"]))  # type: ignore[call-overload]
            (Path(tmp) / case).mkdir()
            results["cases"][case] = bench_case(case, n, Path(tmp) / case, args.tf_python)  # type: ignore[index]
    for case, res in results["cases"].items():  # type: ignore[attr-defined]
        print(f"\n{case}: N={res['n']}, batch {res['batch']} (2nd epoch; ratios within this run)")
        print(
            f"  {'configuration':34}{'samples/s':>12}{'GB/s':>8}{'vs floor':>10}{'shm is x faster':>17}"
        )
        for label, r in res["rows"].items():
            print(
                f"  {label:34}{r['samples_s']:>12,.0f}{r['gb_s']:>8.2f}{r['vs_floor']:>10.2f}"
                f"{r['shardserve_speedup']:>17.2f}"
            )
        for label in ("shm", "ipc", "tcp"):
            r = res["rows"][f"shardserve {label}"]
            print(
                f"  shardserve {label}: client {r['client_cpu_us_per_batch']:.0f} us CPU/batch, "
                f"server {r.get('server_cpu_s_per_gb', float('nan')):.2f} CPU s/GB, stall {r['stall_fraction']:.2f}"
            )
        for t in res["targets"]:
            print(
                f"  target {t['target']} {t['op']} {t['goal']}: {t['value']:.2f} "
                f"{'met' if t['met'] else 'MISSED'}"
            )
        if res["rss"]:
            print(f"  RSS: {res['rss']}")
        if t := res["time_to_first_batch"]:
            print(
                f"  time to first batch from Loader construction: median {t['median_s'] * 1000:.1f} ms "
                f"(min {t['min_s'] * 1000:.1f}, max {t['max_s'] * 1000:.1f})"
            )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
