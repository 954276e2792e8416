"""Server-side transforms: shardserve with transforms vs. DataLoader workers.

    python bench/bench_transforms.py [--quick] [--workdir DIR] [--images N] [--cifar-only]

Three rows, each measured in this one run (ratios, not absolute numbers, are the point):

1. CIFAR-like, N=50,000 (``uint8[3,32,32]`` + label), batch 256: random crop (padding 4) +
   horizontal flip + normalize to float32. shardserve runs the built-ins on the server
   (``random_crop``, ``hflip``, ``normalize``); the baseline is ``DataLoader`` over a
   ``TensorDataset`` with the same per-sample transforms written in torch, ``num_workers``
   0 and 2, and the trainer doing it on whole batches itself (an expert's batched torch ops:
   ``index_select``, pad, one gather of windows, a masked flip, normalize in place). Also the
   trainer's CPU seconds per batch, with and without server transforms, and the server's
   with none, a trivial batch transform (what running a chain costs) and the chain.
   Targets: >= 1.5x the batched torch ops and >= 4x the best DataLoader; trainer CPU per
   batch no higher than without; a chain's cost beyond its transforms' work <= 0.3 ms a batch.
2. ImageFolder of ``--images`` (default 10,000) generated JPEGs of varied sizes (48..160 px a
   side), batch 64: decode + random resized crop to 64x64. shardserve (``decode_image`` +
   ``random_resized_crop`` with ``method="pillow"`` on the server's threads, the numpy
   resampler too, and ``decode_random_resized_crop`` in one step on threads and on 1 and 2
   worker processes) vs ``DataLoader`` with PIL per sample
   (``Image.open`` + a box resize), ``num_workers`` 2. Targets: >= 1.5x its throughput with
   the trainer spending <= 10% of DataLoader's CPU (main process + workers); 2 worker
   processes >= 1.6x one.
3. Transform throughput with 1 and 2 server workers, thread vs process pool: 10,000 CIFAR
   samples through a per-sample ``resize`` (a sample transform: batches are split across
   the workers).

Each configuration runs a warm-up epoch then a measured one. Writes
``bench/results/transforms.json``. ``--quick``: N/10 and 1,000 images.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from _support import make_cifar_like, run_server
from torch.utils.data import DataLoader, Dataset

from shardserve.client import Loader

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results" / "transforms.json"
MEAN, STD = [0.4914, 0.4822, 0.4465], [0.247, 0.243, 0.261]
CIFAR_CHAIN = [
    {"name": "random_crop", "params": {"size": 32, "padding": 4, "layout": "CHW"}},
    {"name": "hflip", "params": {"layout": "CHW"}},
    {"name": "normalize", "params": {"layout": "CHW", "scale": 1 / 255, "mean": MEAN, "std": STD}},
]
IMAGE_CHAIN = [
    {"name": "decode_image"},
    # Pillow's resampler, as the DataLoader baseline uses (the numpy one is measured too).
    {"name": "random_resized_crop", "params": {"size": 64, "method": "pillow"}},
]
IMAGE_CHAIN_NUMPY = [IMAGE_CHAIN[0], {"name": "random_resized_crop", "params": {"size": 64}}]
#: The same in one step: the crop's box from the JPEG's header, then decode (scaled down
#: where the crop allows) and resize.
IMAGE_FUSED = [{"name": "decode_random_resized_crop", "params": {"size": 64}}]
#: A batch transform that does next to nothing (labels times two, from the tests' module):
#: the server's CPU per batch with it, less without, is what running a chain costs.
TRIVIAL_MODULE = "tests.transforms.mods"
TRIVIAL_CHAIN = [{"name": "double_into"}]
RESIZE_CHAIN = [{"name": "resize", "params": {"size": 24, "layout": "CHW"}}]


def cpu_self() -> float:
    return time.process_time()


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def tree_cpu(pid: int, include_self: bool = True, reaped: bool = False) -> float:
    """CPU seconds of ``pid``'s live descendants (and of ``pid`` itself); ``reaped``: also
    of the children ``pid`` already reaped (transform workers that were replaced)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, ([pid] if include_self else _children(pid))
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            if reaped and p == pid:  # cutime + cstime
                total += (int(fields[13]) + int(fields[14])) / tick
        except (OSError, IndexError):
            continue
        todo += _children(p)
    return total


def measure(
    epoch_iter: Callable[[int], Iterable[dict[str, torch.Tensor]]], n: int
) -> dict[str, float]:
    """Warm-up epoch, then a measured one: samples/s, trainer CPU s per batch."""
    for e in range(2):
        t0, c0 = time.perf_counter(), cpu_self()
        count = batches = 0
        for b in epoch_iter(e):
            float(next(iter(b.values())).reshape(-1)[-1])  # the batch exists
            count += len(b["label"])
            batches += 1
        dt, cpu = time.perf_counter() - t0, cpu_self() - c0
    assert count >= n * 0.99, f"epoch delivered {count} of {n}"
    return {"samples_s": count / dt, "epoch_s": dt, "trainer_cpu_s_per_batch": cpu / batches}


def loader_epochs(
    url: str, name: str, batch: int, chain: list | None, copy: bool = True
) -> Callable[[int], Iterable]:
    loader = Loader(url, name, batch_size=batch, seed=0, transforms=chain, timeout=120, copy=copy)

    def epoch(e: int) -> Iterable[dict[str, torch.Tensor]]:
        loader.set_epoch(e)
        return loader

    return epoch


# -- row 1: CIFAR in torch ---------------------------------------------------------------------
class CifarTorch(Dataset):
    """TensorDataset + per-sample crop/flip/normalize, as a torchvision recipe would do."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        img = torch.nn.functional.pad(self.images[i], (4, 4, 4, 4))
        y, x = torch.randint(0, 9, (2,)).tolist()
        img = img[:, y : y + 32, x : x + 32]
        if torch.rand(()) < 0.5:
            img = img.flip(-1)
        img = (img.float() / 255 - self.mean) / self.std
        return {"image": img, "label": self.labels[i]}


def dataloader(ds: Dataset, workers: int, batch: int) -> Callable[[int], Iterable]:
    dl = DataLoader(
        ds, batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=workers > 0
    )
    return lambda e: dl


def expert_epochs(
    images: torch.Tensor, labels: torch.Tensor, batch: int = 256
) -> Callable[[int], Iterable]:
    """The trainer doing the CIFAR recipe itself on whole batches, as an expert would: one
    ``index_select``, one pad, the crops as one gather of windows, the flips as one masked
    write, normalize in place."""
    n = len(labels)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)

    def epoch(e: int) -> Iterable[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(e)
        perm = torch.randperm(n, generator=g)
        for i in range(0, n, batch):
            idx = perm[i : i + batch]
            b = len(idx)
            x = torch.nn.functional.pad(images.index_select(0, idx), (4, 4, 4, 4))
            oy, ox = torch.randint(0, 9, (2, b), generator=g)
            x = x.unfold(2, 32, 1).unfold(3, 32, 1)[torch.arange(b), :, oy, ox]
            flip = torch.rand(b, generator=g) < 0.5
            x[flip] = x[flip].flip(-1)
            x = x.float().div_(255).sub_(mean).div_(std)
            yield {"image": x, "label": labels.index_select(0, idx)}

    return epoch


# -- row 2: images -----------------------------------------------------------------------------
def make_images(root: Path, n: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(10):
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        h, w = rng.integers(48, 161, 2)
        # Smooth content (JPEG of noise is unrealistically large and slow to decode).
        base = rng.integers(0, 255, (4, 4, 3), dtype=np.uint8)
        img = Image.fromarray(base).resize((int(w), int(h)), Image.BILINEAR)
        img.save(root / f"class{i % 10}" / f"{i:06d}.jpg", quality=90)


class FolderPIL(Dataset):
    """ImageFolder with PIL: decode + RandomResizedCrop (scale 0.08..1, ratio 3/4..4/3)."""

    def __init__(self, root: Path) -> None:
        classes = sorted(p.name for p in root.iterdir())
        self.items = [
            (p, c) for c, name in enumerate(classes) for p in sorted((root / name).iterdir())
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        from PIL import Image

        path, label = self.items[i]
        with Image.open(path) as im:
            im = im.convert("RGB")
            W, H = im.size
            rng = np.random.default_rng()
            for _ in range(10):
                area = W * H * rng.uniform(0.08, 1.0)
                ar = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
                w, h = round(np.sqrt(area * ar)), round(np.sqrt(area / ar))
                if 0 < w <= W and 0 < h <= H:
                    x0, y0 = rng.integers(0, W - w + 1), rng.integers(0, H - h + 1)
                    break
            else:
                x0, y0, w, h = 0, 0, W, H
            out = im.resize((64, 64), Image.BILINEAR, box=(x0, y0, x0 + w, y0 + h))
        return {"image": torch.from_numpy(np.asarray(out).copy()), "label": torch.tensor(label)}


def cifar_ratios(rows: dict[str, dict[str, float]]) -> dict[str, float]:
    """Row 1's ratios (and the server's CPU per batch, ms, with the chain and what a trivial
    chain adds to none)."""
    best_dl = max(
        rows[f"DataLoader num_workers={w}, torch transforms"]["samples_s"] for w in (0, 2)
    )
    tr = rows["shardserve, server transforms"]
    bare = rows["shardserve, no transforms (uint8)"]
    trivial = rows["shardserve, trivial batch transform (labels x 2)"]
    return {
        "cifar_vs_best_dataloader": tr["samples_s"] / best_dl,
        "cifar_vs_expert_batched_torch": tr["samples_s"]
        / rows["trainer, batched torch ops (expert)"]["samples_s"],
        "cifar_server_cpu_ms_per_batch": tr["server_cpu_s_per_batch"] * 1000,
        "chain_overhead_server_cpu_ms_per_batch": (
            trivial["server_cpu_s_per_batch"] - bare["server_cpu_s_per_batch"]
        )
        * 1000,
        "cifar_trainer_cpu_vs_no_transforms": tr["trainer_cpu_s_per_batch"]
        / bare["trainer_cpu_s_per_batch"],
        "cifar_trainer_cpu_copy_false_vs_no_transforms": rows[
            "shardserve, server transforms, copy=False"
        ]["trainer_cpu_s_per_batch"]
        / bare["trainer_cpu_s_per_batch"],
    }


def sizes(args: argparse.Namespace) -> tuple[int, int]:
    """CIFAR samples and JPEGs of this run."""
    return (5_000 if args.quick else 50_000), args.images or (1_000 if args.quick else 10_000)


def report(
    args: argparse.Namespace,
    rows: dict[str, dict[str, float]],
    ratios: dict[str, float],
    load: dict[str, list[float]],
) -> int:
    """Print the ratios, write the results file."""
    n, n_img = sizes(args)
    print("\nratios:")
    for k, v in ratios.items():
        print(f"  {k:<40} {v:6.2f}")
    out = {
        "bench": "transforms",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "config": {"cifar_n": n, "images": n_img, "quick": args.quick},
        "load_average": load,
        "rows": rows,
        "ratios": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--images", type=int, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--cifar-only", action="store_true", help="row 1 only")
    args = ap.parse_args(argv)
    n, n_img = sizes(args)
    torch.set_num_threads(1)
    rows: dict[str, dict[str, float]] = {}
    load: dict[str, list[float]] = {}

    def record(label: str, res: dict[str, float]) -> None:
        rows[label] = res
        print(
            f"{label:<44} {res['samples_s']:>10,.0f} samples/s   trainer CPU "
            f"{res['trainer_cpu_s_per_batch'] * 1000:7.2f} ms/batch"
            + (
                f"   (workers CPU {res['workers_cpu_s_per_batch'] * 1000:.2f} ms/batch)"
                if "workers_cpu_s_per_batch" in res
                else ""
            )
            + (
                f"   server CPU {res['server_cpu_s_per_batch'] * 1000:.2f} ms/batch"
                if "server_cpu_s_per_batch" in res
                else ""
            ),
            flush=True,
        )

    with tempfile.TemporaryDirectory(prefix="ss-bench-tf-") as tmp:
        work = args.workdir or Path(tmp)
        store = work / "store"
        if not (store / "cifar" / "manifest.json").exists():
            make_cifar_like(store, "cifar", n=n, shard_bytes=64 << 20)
        n_small = n // 5  # row 3 runs four servers: a fifth of the samples keeps it short
        if not (store / "cifar_small" / "manifest.json").exists():
            make_cifar_like(store, "cifar_small", n=n_small, shard_bytes=64 << 20)

        print("\n-- 1. CIFAR-like: random crop (pad 4) + flip + normalize, batch 256")
        print(f"load average at start: {os.getloadavg()}")
        load["cifar_start"] = list(os.getloadavg())
        with run_server(
            store, "--transform-workers", "2", "--transforms", TRIVIAL_MODULE, timeout=60
        ) as srv:
            for label, chain, copy in (
                ("shardserve, no transforms (uint8)", None, True),
                ("shardserve, trivial batch transform (labels x 2)", TRIVIAL_CHAIN, True),
                ("shardserve, server transforms", CIFAR_CHAIN, True),
                ("shardserve, server transforms, copy=False", CIFAR_CHAIN, False),
            ):
                c0 = tree_cpu(srv.proc.pid)
                res = measure(loader_epochs(srv.http_url, "cifar", 256, chain, copy=copy), n)
                # measure() runs two epochs (warm-up and measured): the server's CPU over both.
                res["server_cpu_s_per_batch"] = (tree_cpu(srv.proc.pid) - c0) / (2 * -(-n // 256))
                record(label, res)
        from shardserve.server.store.catalog import Store

        ds = Store(store).open("cifar")
        arr = ds.take(np.arange(n), ["image", "label"])
        images, labels = (
            torch.from_numpy(arr["image"].copy()),
            torch.from_numpy(arr["label"].copy()),
        )
        record("trainer, batched torch ops (expert)", measure(expert_epochs(images, labels), n))
        for w in (0, 2):
            res = measure(dataloader(CifarTorch(images, labels), w, 256), n)
            record(f"DataLoader num_workers={w}, torch transforms", res)
        load["cifar_end"] = list(os.getloadavg())
        print(f"load average at end: {os.getloadavg()}")
        if args.cifar_only:
            return report(args, rows, cifar_ratios(rows), load)

        folder = work / "images"
        if not (store / "images" / "manifest.json").exists():
            t0 = time.perf_counter()
            make_images(folder, n_img)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "shardserve.server",
                    "ingest",
                    str(folder),
                    "--store",
                    str(store),
                    "--name",
                    "images",
                    "--quiet",
                ],
                check=True,
            )
            print(
                f"made and ingested {n_img} JPEGs in {time.perf_counter() - t0:.1f} s", flush=True
            )
        print(f"\n-- 2. ImageFolder of {n_img} JPEGs: decode + random resized crop 64, batch 64")
        # The decoders run on worker processes by default; threads are asked for here.
        with run_server(store, "--transform-pool", "thread", timeout=60) as srv:
            record(
                "shardserve, server decode + crop, 2 threads",
                measure(loader_epochs(srv.http_url, "images", 64, IMAGE_CHAIN), n_img),
            )
            record(
                "shardserve, same with numpy resize, 2 threads",
                measure(loader_epochs(srv.http_url, "images", 64, IMAGE_CHAIN_NUMPY), n_img),
            )
            record(
                "shardserve, decode_random_resized_crop, 2 threads",
                measure(loader_epochs(srv.http_url, "images", 64, IMAGE_FUSED), n_img),
            )
        # Worker processes read the JPEG bytes from a shared file and write the crops into
        # the stream's slots; one and two of them.
        for workers in (1, 2):
            with run_server(
                store,
                "--transform-pool",
                "process",
                "--transform-workers",
                str(workers),
                timeout=60,
            ) as srv:
                record(
                    f"shardserve, decode_random_resized_crop, {workers} worker process(es)",
                    measure(loader_epochs(srv.http_url, "images", 64, IMAGE_FUSED), n_img),
                )
                if workers == 2:
                    record(
                        "shardserve, server decode + crop, 2 worker processes",
                        measure(loader_epochs(srv.http_url, "images", 64, IMAGE_CHAIN), n_img),
                    )
        epochs = dataloader(FolderPIL(folder), 2, 64)
        c0 = tree_cpu(os.getpid(), include_self=False)
        dl_res = measure(epochs, n_img)
        # Persistent workers (still alive) over both epochs, per measured batch: halved.
        spent = tree_cpu(os.getpid(), include_self=False) - c0
        dl_res["workers_cpu_s_per_batch"] = spent / 2 / max(1, n_img // 64)
        record("DataLoader num_workers=2, PIL", dl_res)

        print("\n-- 3. transform pool scaling: per-sample resize of the CIFAR samples, batch 256")
        for kind in ("thread", "process"):
            for workers in (1, 2):
                with run_server(
                    store, "--transform-pool", kind, "--transform-workers", str(workers), timeout=60
                ) as srv:
                    record(
                        f"{kind} pool, {workers} worker(s)",
                        measure(
                            loader_epochs(srv.http_url, "cifar_small", 256, RESIZE_CHAIN), n_small
                        ),
                    )

    img = rows["shardserve, server decode + crop, 2 threads"]
    dl = rows["DataLoader num_workers=2, PIL"]
    dl_cpu = dl["trainer_cpu_s_per_batch"]
    ratios = {
        **cifar_ratios(rows),
        "images_vs_dataloader": img["samples_s"] / dl["samples_s"],
        "images_2_processes_vs_dataloader": rows[
            "shardserve, server decode + crop, 2 worker processes"
        ]["samples_s"]
        / dl["samples_s"],
        "images_one_step_threads_vs_dataloader": rows[
            "shardserve, decode_random_resized_crop, 2 threads"
        ]["samples_s"]
        / dl["samples_s"],
        "images_one_step_2_processes_vs_dataloader": rows[
            "shardserve, decode_random_resized_crop, 2 worker process(es)"
        ]["samples_s"]
        / dl["samples_s"],
        "images_process_2_vs_1": rows[
            "shardserve, decode_random_resized_crop, 2 worker process(es)"
        ]["samples_s"]
        / rows["shardserve, decode_random_resized_crop, 1 worker process(es)"]["samples_s"],
        "images_trainer_cpu_vs_dataloader_main": img["trainer_cpu_s_per_batch"] / dl_cpu,
        "images_trainer_cpu_vs_dataloader_all": img["trainer_cpu_s_per_batch"]
        / (dl_cpu + dl.get("workers_cpu_s_per_batch", 0.0)),
        "thread_2_vs_1": rows["thread pool, 2 worker(s)"]["samples_s"]
        / rows["thread pool, 1 worker(s)"]["samples_s"],
        "process_2_vs_1": rows["process pool, 2 worker(s)"]["samples_s"]
        / rows["process pool, 1 worker(s)"]["samples_s"],
    }
    return report(args, rows, ratios, load)


if __name__ == "__main__":
    sys.exit(main())
