"""Shared passes for sweeps (``Loader(share=...)``): 4 trials on one node, shared vs separate.

    python bench/bench_share.py [--quick] [--workdir DIR] [--samples N] [--images N]
                                [--trials K] [--epochs E] [--repeats R] [--only a,b]

Each row starts one server (``--transform-workers 2``) and ``--trials`` (4) trainer
processes (``multiprocessing`` spawn, ``torch.set_num_threads(1)``). Every trial holds two
Loaders of the row's dataset and chain, one per mode:

* **separate**: seeds 0..3, no ``share`` (what a sweep does today: identical Loaders would
  conflict with ``RankInUse``), so the server plans, gathers and transforms every batch 4
  times;
* **shared**: seed 0 in every trial with ``share="bench-<row>"``: one server pass per rank,
  each batch assembled once and delivered to every subscriber.

The trials iterate the same windows at once (each started after a barrier): a warm-up epoch
of each mode, then ``--repeats`` (2) rounds of a separate window and a shared window of
``--epochs`` epochs each (3; 2 with ``--quick``; 8x that for the cheap no-transform row), so
both modes see the same machine, alternately. Each mode's row is its best window (the
machine is shared: the least disturbed one); every window is in the JSON.

Rows (the transforms are bench_transforms' chains):

1. ``cifar``: CIFAR-like ``uint8[3,32,32]`` + label, batch 256, no transforms (for reference:
   gathering is cheap, delivery is most of the server's work).
2. ``cifar-tf``: the same with ``random_crop`` (pad 4) + ``hflip`` + ``normalize`` to float32.
3. ``jpeg``: an ImageFolder of generated JPEGs (48..160 px a side), batch 64:
   ``decode_image`` + ``random_resized_crop`` to 64 (``method="pillow"``).

Per window: aggregate samples/s = samples delivered to all trials / (last trial's end -
first trial's start); server CPU seconds (the server process and its transform workers,
from ``/proc/<pid>/stat``) per delivered batch; ``shardserve_batches_sent_total`` and
``shardserve_batches_assembled_total`` from ``GET /metrics`` (a shared batch is assembled
once); ``detached``: times a shared trial fell out of its group's window (``stats()``).
Shared trials must receive the same batches (their label sequences are compared).

Targets, transform rows: shared >= 2.5x the separate aggregate samples/s, and server CPU per
delivered batch <= 0.35x separate. Ratios are within this one run (a shared, noisy 2-core
machine). Writes ``bench/results/share.json``. ``--quick``: 20,000 CIFAR samples and 1,000
JPEGs (default 50,000 and 4,000).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _support import make_cifar_like, run_server
from bench_transforms import CIFAR_CHAIN, IMAGE_CHAIN, make_images, tree_cpu

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results" / "share.json"
TRIALS = 4
MODES = ("separate", "shared")
#: Longest a trial waits for the others at a barrier, or the parent for the trials.
WAIT_S = 600.0
#: Data ("cifar" or "images"), batch size, chain, epochs per window (times --epochs).
ROWS: dict[str, tuple[str, int, list | None, int]] = {
    "cifar": ("cifar", 256, None, 8),
    "cifar-tf": ("cifar", 256, CIFAR_CHAIN, 1),
    "jpeg": ("images", 64, IMAGE_CHAIN, 1),
}
TITLES = {
    "cifar": "CIFAR-like, batch 256, no transforms (reference)",
    "cifar-tf": "CIFAR-like, batch 256: random crop (pad 4) + flip + normalize",
    "jpeg": "JPEG folder, batch 64: decode + random resized crop 64 (pillow)",
}
TRANSFORM_ROWS = ("cifar-tf", "jpeg")
TARGET_SPEEDUP, TARGET_CPU = 2.5, 0.35


# -- one trial (a trainer process) ---------------------------------------------------------
def trial(
    i: int,
    url: str,
    dataset: str,
    batch: int,
    chain: list | None,
    share: str,
    windows: list[tuple[str, int]],
    barrier: Any,
    results: Any,
) -> None:
    """Iterate ``windows`` (mode, epochs), each started together with the other trials and
    the parent (``barrier``); put each window's facts on ``results`` (or the error)."""
    loaders: dict[str, Any] = {}
    try:
        import torch

        from shardserve.client import Loader

        torch.set_num_threads(1)
        kw = dict(batch_size=batch, transforms=chain, rank=0, world_size=1, timeout=120)
        loaders["separate"] = Loader(url, dataset, seed=i, **kw)  # type: ignore[arg-type]
        loaders["shared"] = Loader(url, dataset, seed=0, share=share, **kw)  # type: ignore[arg-type]
        next_epoch = dict.fromkeys(MODES, 0)
        for w, (mode, epochs) in enumerate(windows):
            barrier.wait(WAIT_S)  # every trial idle: the parent reads the server's counters
            barrier.wait(WAIT_S)  # go
            loader, digest = loaders[mode], hashlib.blake2b(digest_size=12)
            s0, t0, c0 = loader.stats(), time.monotonic(), time.process_time()
            samples = batches = 0
            for _ in range(epochs):
                loader.set_epoch(next_epoch[mode])
                next_epoch[mode] += 1
                for b in loader:
                    float(b["image"].reshape(-1)[-1])  # the batch exists
                    digest.update(b["label"].numpy().tobytes())
                    samples += len(b["label"])
                    batches += 1
            t1, cpu, s1 = time.monotonic(), time.process_time() - c0, loader.stats()
            results.put(
                {
                    "window": w,
                    "trial": i,
                    "start": t0,
                    "end": t1,
                    "samples": samples,
                    "batches": batches,
                    "client_cpu_s": cpu,
                    "labels_digest": digest.hexdigest(),
                    "detached": s1.detached - s0.detached,
                    "reconnects": s1.reconnects - s0.reconnects,
                    "wait_s": s1.wait_s - s0.wait_s,
                    "transport": s1.transport,
                }
            )
        barrier.wait(WAIT_S)  # the parent read the counters after the last window: done
    except BaseException as e:  # reported to the parent, which reports it
        barrier.abort()
        results.put({"trial": i, "error": f"{type(e).__name__}: {e}"})
    finally:
        for loader in loaders.values():
            with contextlib.suppress(Exception):
                loader.close()


# -- the server's side ---------------------------------------------------------------------
def server_cpu(pid: int) -> float:
    """CPU seconds of the server and its transform workers, live and reaped."""
    return tree_cpu(pid, reaped=True)


def scrape(url: str) -> dict[str, float]:
    """The two batch counters from ``GET /metrics`` (NaN where the server has none)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {"sent": math.nan, "assembled": math.nan}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "shardserve_batches_sent_total":
            out["sent"] = float(value)
        elif name == "shardserve_batches_assembled_total":
            out["assembled"] = float(value)
    return out


# -- one row: a server, the trials, the windows --------------------------------------------
def run_row(
    store: Path, dataset: str, row: str, trials: int, epochs: int, repeats: int, workers: int
) -> dict[str, Any]:
    _, batch, chain, scale = ROWS[row]
    windows = [(m, 1) for m in MODES] + [(m, epochs * scale) for _ in range(repeats) for m in MODES]
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(trials + 1), ctx.Queue()
    readings: list[tuple[float, dict[str, float]]] = []
    out: list[dict[str, Any]] = []
    error = None
    with run_server(store, "--transform-workers", str(workers), timeout=60) as srv:
        procs = []
        for i in range(trials):
            args = (
                i,
                srv.http_url,
                dataset,
                batch,
                chain,
                f"bench-{row}",
                windows,
                barrier,
                results,
            )
            procs.append(ctx.Process(target=trial, args=args, daemon=True))
            procs[-1].start()
        try:
            for _ in range(len(windows) + 1):
                barrier.wait(WAIT_S)  # every trial idle
                readings.append((server_cpu(srv.proc.pid), scrape(srv.http_url)))
                if len(readings) <= len(windows):
                    barrier.wait(WAIT_S)  # go
        except threading.BrokenBarrierError:
            barrier.abort()
            error = "a trial failed (or a barrier timed out)"
        deadline = time.monotonic() + 60
        while len(out) < trials * len(windows) and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                out.append(results.get(timeout=1.0))
            if any("error" in r for r in out):
                with contextlib.suppress(queue.Empty):  # the other trials' errors, if any
                    while True:
                        out.append(results.get(timeout=2.0))
                break
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        errors = sorted({r["error"] for r in out if "error" in r})
        if errors or error:
            return {"error": "; ".join(errors) or error, "log_tail": srv.log_tail(2000)}
    measured = []
    for w, (mode, _) in enumerate(windows):
        if w < len(MODES):
            continue  # warm-up
        got = [r for r in out if r["window"] == w]
        (cpu0, m0), (cpu1, m1) = readings[w], readings[w + 1]
        measured.append({"mode": mode, "window": w, **summarize(got, cpu1 - cpu0, m0, m1)})
    best = {
        m: max((r for r in measured if r["mode"] == m), key=lambda r: r["samples_s"]) for m in MODES
    }
    return {**best, "windows": measured}


def summarize(
    out: list[dict[str, Any]], cpu: float, m0: dict[str, float], m1: dict[str, float]
) -> dict[str, Any]:
    out.sort(key=lambda r: r["trial"])
    samples, batches = sum(r["samples"] for r in out), sum(r["batches"] for r in out)
    wall = max(r["end"] for r in out) - min(r["start"] for r in out)
    return {
        "samples_s": samples / wall,
        "wall_s": wall,
        "samples": samples,
        "batches_delivered": batches,
        "server_cpu_s": cpu,
        "server_cpu_ms_per_batch": cpu / batches * 1e3,
        "metrics_batches_sent": m1["sent"] - m0["sent"],
        "metrics_batches_assembled": m1["assembled"] - m0["assembled"],
        "client_cpu_ms_per_batch": sum(r["client_cpu_s"] for r in out) / batches * 1e3,
        "client_wait_s": [round(r["wait_s"], 3) for r in out],
        "trial_samples_s": [round(r["samples"] / (r["end"] - r["start"])) for r in out],
        "trial_samples": [r["samples"] for r in out],
        "detached": sum(r["detached"] for r in out),
        "reconnects": sum(r["reconnects"] for r in out),
        "transport": sorted({r["transport"] for r in out}),
        # Shared trials get the same batches; separate ones (other seeds) other orders.
        "same_batches": len({r["labels_digest"] for r in out}) == 1,
    }


# -- report --------------------------------------------------------------------------------
def fmt(x: float, spec: str) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else format(x, spec)


def print_row(label: str, r: dict[str, Any]) -> None:
    print(
        f"  {label:<10}{r['samples_s']:>12,.0f}{r['wall_s']:>8.2f}{r['batches_delivered']:>8}"
        f"{fmt(r['metrics_batches_assembled'], '>10,.0f')}{fmt(r['metrics_batches_sent'], '>8,.0f')}"
        f"{r['server_cpu_ms_per_batch']:>12.2f}{r['client_cpu_ms_per_batch']:>12.2f}"
        f"{r['detached']:>7}  {'yes' if r['same_batches'] else 'no ':<3}"
        f"  {' '.join(f'{s:,.0f}' for s in r['trial_samples_s'])}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes, about two minutes")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the data here (reused)")
    ap.add_argument("--samples", type=int, default=None, help="CIFAR-like samples")
    ap.add_argument("--images", type=int, default=None, help="generated JPEGs")
    ap.add_argument("--trials", type=int, default=TRIALS, help="trainer processes")
    ap.add_argument("--epochs", type=int, default=None, help="epochs a window (3; quick 2)")
    ap.add_argument("--repeats", type=int, default=2, help="measured windows of each mode")
    ap.add_argument("--transform-workers", type=int, default=2)
    ap.add_argument("--only", default="", help=f"rows to run, comma-separated, of {list(ROWS)}")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    n = args.samples or (20_000 if args.quick else 50_000)
    n_img = args.images or (1_000 if args.quick else 4_000)
    epochs = args.epochs or (2 if args.quick else 3)
    only = [w for w in args.only.split(",") if w] or list(ROWS)
    if unknown := set(only) - set(ROWS):
        ap.error(f"unknown rows {sorted(unknown)}: pick from {list(ROWS)}")
    res: dict[str, Any] = {
        "bench": "share",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "config": {
            "cifar_n": n,
            "images": n_img,
            "trials": args.trials,
            "epochs": epochs,
            "repeats": args.repeats,
            "transform_workers": args.transform_workers,
            "quick": args.quick,
        },
        "load_before": os.getloadavg(),
        "rows": {},
    }
    with tempfile.TemporaryDirectory(prefix="ss-bench-share-") as tmp:
        work = args.workdir or Path(tmp)
        store = work / "store"
        # Named by their size: a --workdir kept from a run of other sizes is reused right.
        names = {"cifar": f"cifar-{n}", "images": f"images-{n_img}"}
        data = {ROWS[row][0] for row in only}
        if "cifar" in data and not (store / names["cifar"] / "manifest.json").exists():
            make_cifar_like(store, names["cifar"], n=n, shard_bytes=64 << 20)
        if "images" in data and not (store / names["images"] / "manifest.json").exists():
            t0 = time.perf_counter()
            make_images(work / names["images"], n_img)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "shardserve.server",
                    "ingest",
                    str(work / names["images"]),
                    "--store",
                    str(store),
                    "--name",
                    names["images"],
                    "--quiet",
                ],
                check=True,
            )
            print(f"made and ingested {n_img} JPEGs in {time.perf_counter() - t0:.1f} s")
        for row in only:
            t0 = time.perf_counter()
            scale = ROWS[row][3]
            print(
                f"\n-- {TITLES[row]}: {args.trials} trials at once, best of {args.repeats} "
                f"windows of {epochs * scale} epochs",
                flush=True,
            )
            r = res["rows"][row] = run_row(
                store,
                names[ROWS[row][0]],
                row,
                args.trials,
                epochs,
                args.repeats,
                args.transform_workers,
            )
            if "error" in r:
                print(f"  FAILED: {r['error']}\n  server log tail:\n{r['log_tail']}", flush=True)
                continue
            print(
                f"  {'mode':<10}{'samples/s':>12}{'wall s':>8}{'batches':>8}{'assembled':>10}"
                f"{'sent':>8}{'srv ms/bat':>12}{'cli ms/bat':>12}{'detach':>7}  same"
                f"  per trial samples/s"
            )
            for mode in MODES:
                print_row(mode, r[mode])
            others = [w for w in r["windows"] if w is not r["separate"] and w is not r["shared"]]
            print(
                "  other windows: "
                + "; ".join(
                    f"{w['mode']} {w['samples_s']:,.0f}/s {w['server_cpu_ms_per_batch']:.2f} ms/bat"
                    f"{' detached ' + str(w['detached']) if w['detached'] else ''}"
                    for w in others
                )
                + f"  ({time.perf_counter() - t0:.0f} s)"
            )
    res["load_after"] = os.getloadavg()

    def ratio(row: str, key: str) -> float:
        r = res["rows"][row]
        return r["shared"][key] / r["separate"][key] if "error" not in r else math.nan

    res["ratios"] = {
        row: {
            "samples_s": ratio(row, "samples_s"),
            "server_cpu_per_batch": ratio(row, "server_cpu_ms_per_batch"),
        }
        for row in res["rows"]
    }
    print(
        f"\nload average before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f} "
        f"({os.cpu_count()} cpus)"
    )
    print("ratios shared / separate (same run):")
    for row, q in res["ratios"].items():
        print(
            f"  {row:<10} aggregate samples/s {fmt(q['samples_s'], '5.2f')}x   "
            f"server CPU per delivered batch {fmt(q['server_cpu_per_batch'], '5.2f')}x"
        )
    res["targets"] = [
        t
        for row in TRANSFORM_ROWS
        if row in res["ratios"]
        for t in (
            (
                f"{row} shared / separate samples/s",
                res["ratios"][row]["samples_s"],
                ">=",
                TARGET_SPEEDUP,
            ),
            (
                f"{row} shared / separate server CPU per batch",
                res["ratios"][row]["server_cpu_per_batch"],
                "<=",
                TARGET_CPU,
            ),
        )
    ]
    for name, value, op, goal in res["targets"]:
        met = value >= goal if op == ">=" else value <= goal
        print(f"  target {name} {op} {goal}: {fmt(value, '.2f')} {'met' if met else 'MISSED'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {args.out}")
    failed = [row for row, r in res["rows"].items() if "error" in r]
    if failed:
        print(f"FAILED: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
