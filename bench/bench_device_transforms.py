"""Device-executed steps (``device_transforms``): compact records shipped, expanded by the
trainer's device, against the server expanding them; on a GPU, images decoded and augmented
on the device against DataLoader workers and against data already decoded on the GPU.

    python bench/bench_device_transforms.py --device cpu --quick     # CI-sized, any machine
    python bench/bench_device_transforms.py --device cuda            # the GPU rows too

Rows (each measured in this run against its baseline in the same run; each has its own time
budget, and ``bench/results/device-transforms.json`` is rewritten as each row finishes):

* ``shogi``: shogi-like records, 1,053 packed bytes each (104 x 9 x 9 bits), batch 256, to
  float32 planes (8.6 MB a batch): the server expanding them (``transforms=[unpack_bits]``)
  vs the client expanding them on ``--device`` (``device_transforms=[unpack_bits]``, and a
  featurizer of its own registered with ``register_expansion``). Trainer-side CPU per batch
  (this process's CPU time: the Loader's thread, the steps, a consumer reading the planes)
  and bytes moved per batch (over the data plane).
* ``images`` (CUDA and torchvision only): ImageFolder-style JPEGs (>= 20,000, 200-500 px a
  side, generated here) feeding a ResNet-50 bf16 channels-last training loop: device-executed
  decode + random resized crop 224 + flip + normalize vs DataLoader with 8 workers (PIL) vs
  data decoded on the GPU beforehand (the ceiling); CPU per image counting DataLoader's
  workers and main process. Targets: >= 0.8x the ceiling and >= 2x DataLoader w8 (or >= 0.9x
  the ceiling where DataLoader w8 reaches half of it); CPU per image <= 0.2x DataLoader's.

Without CUDA (or without torchvision) the GPU rows are written as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _support import run_server
from bench_transforms import tree_cpu

from shardserve.client import Loader
from shardserve.client.device_steps import register_expansion
from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.write.writer import ShardWriter

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results" / "device-transforms.json"
PLANES = [104, 9, 9]
RECORD = -(-int(np.prod(PLANES)) // 8)  # 1,053 bytes
UNPACK = {"name": "unpack_bits", "params": {"field": "board", "shape": PLANES, "dtype": "float32"}}
EXPAND = {"name": "expand", "params": {"fn": "shogi", "field": "board"}}
MEAN, STD = [0.485 * 255, 0.456 * 255, 0.406 * 255], [0.229 * 255, 0.224 * 255, 0.225 * 255]
IMAGE_STEPS = [
    {"name": "decode_image"},
    {"name": "random_resized_crop", "params": {"size": 224}},
    {"name": "hflip"},
    {
        "name": "normalize",
        "params": {"mean": MEAN, "std": STD, "to_chw": True, "dtype": "bfloat16"},
    },
]


def shogi_planes(board: torch.Tensor, options: Mapping[str, Any]) -> torch.Tensor:
    """A shogi featurizer written for the device: packed bits to float32 planes
    ``[B, 104, 9, 9]`` in batched tensor ops (a bit per square per plane)."""
    b = board.shape[0]
    shifts = torch.arange(7, -1, -1, device=board.device, dtype=torch.uint8)
    bits = (board.reshape(b, -1, 1) >> shifts) & 1
    return bits.reshape(b, -1)[:, : int(np.prod(PLANES))].reshape(b, *PLANES).float()


class Report:
    """The results file, rewritten after every row (a run cut short keeps what finished)."""

    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        self.out, self.rows = out, {}  # type: dict[str, Any]
        self.head = {
            "bench": "device-transforms",
            "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": {
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "torch": torch.__version__,
                "torchvision": _torchvision_version(),
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            },
            "config": config,
        }

    def row(self, name: str, res: dict[str, Any]) -> None:
        res["loadavg_1m"] = os.getloadavg()[0]
        self.rows[name] = res
        print(f"{name:<36} " + "  ".join(f"{k}={_fmt(v)}" for k, v in res.items()), flush=True)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps({**self.head, "rows": self.rows}, indent=2))


def _fmt(v: Any) -> str:
    return f"{v:,.4g}" if isinstance(v, float) else str(v)


def _torchvision_version() -> str | None:
    try:
        import torchvision
    except Exception:  # a torchvision built for another torch fails at import
        return None
    return str(torchvision.__version__)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- shogi-like records ----------------------------------------------------------------------
def write_shogi(store: Path, n: int) -> None:
    fields = (
        FieldSpec(name="board", dtype="uint8", shape=(RECORD,)),
        FieldSpec(name="label", dtype="int64"),
    )
    rng = np.random.default_rng(0)
    with ShardWriter(store, "shogi", fields=fields, shard_bytes=64 << 20) as w:
        for start in range(0, n, 8192):
            m = min(8192, n - start)
            boards = (rng.random((m, RECORD)) < 0.1).astype(np.uint8) * rng.integers(
                0, 256, (m, RECORD), dtype=np.uint8
            )
            w.add_batch({"board": boards, "label": np.arange(start, start + m, dtype=np.int64)})


def shogi_row(
    url: str, device: torch.device, batch: int, budget_s: float, **kw: Any
) -> dict[str, Any]:
    """Batches/s, trainer CPU per batch and bytes per batch, over at most ``budget_s``."""
    with Loader(url, "shogi", batch, seed=0, device=device, timeout=120, **kw) as loader:
        for _ in zip(range(3), loader, strict=False):  # warm-up: connections, allocator, pages
            pass
        b0 = loader.stats()
        t0, c0, n, checksum = time.perf_counter(), time.process_time(), 0, 0.0
        epoch = 1
        while time.perf_counter() - t0 < budget_s:  # whole epochs until the budget is spent
            loader.set_epoch(epoch)
            for b in loader:
                checksum += float(b["board"].mean())  # the consumer reads every plane
                n += 1
            epoch += 1
        sync(device)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = loader.stats()
    return {
        "batches": n,
        "batches_s": n / dt,
        "trainer_cpu_ms_per_batch": 1000 * cpu / n,
        "wire_bytes_per_batch": (s.bytes - b0.bytes) / max(1, s.batches - b0.batches),
        "delivered_bytes_per_batch": batch * int(np.prod(PLANES)) * 4,
    }


def run_shogi(rep: Report, store: Path, device: torch.device, batch: int, budget_s: float) -> None:
    register_expansion("shogi", shogi_planes)
    with run_server(store) as srv:
        rows = {
            "shogi: server expands": {"transforms": [UNPACK]},
            "shogi: client unpack_bits": {"device_transforms": [UNPACK]},
            "shogi: client expansion": {"device_transforms": [EXPAND]},
        }
        # Same host (shared memory) and, on the CPU, over a socket too (the GPU run is timed).
        for transport in ("auto", "tcp") if device.type == "cpu" else ("auto",):
            for name, kw in rows.items():
                res = shogi_row(srv.http_url, device, batch, budget_s, transport=transport, **kw)
                rep.row(f"{name} ({device.type}, {transport})", res)


# -- images: device steps vs DataLoader vs the ceiling ---------------------------------------
def _jpeg(i: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(i)
    h, w = (int(v) for v in rng.integers(200, 501, 2))
    base = rng.integers(0, 255, (6, 6, 3), dtype=np.uint8)  # smooth content, like photos
    buf = io.BytesIO()
    Image.fromarray(base).resize((w, h), Image.BILINEAR).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def write_images(store: Path, folder: Path, n: int) -> None:
    """``n`` JPEGs as an ImageFolder (for DataLoader) and as a dataset (for shardserve)."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(os.cpu_count()) as pool:
        jpegs = list(pool.map(_jpeg, range(n), chunksize=256))
    fields = (FieldSpec(name="image", dtype="binary"), FieldSpec(name="label", dtype="int64"))
    with ShardWriter(store, "photos", fields=fields, shard_bytes=256 << 20) as w:
        for i, data in enumerate(jpegs):
            (folder / f"c{i % 100}").mkdir(parents=True, exist_ok=True)
            (folder / f"c{i % 100}" / f"{i:06d}.jpg").write_bytes(data)
            w.add({"image": data, "label": np.int64(i % 100)})


def _model(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import torchvision

    model = torchvision.models.resnet50(num_classes=100).to(
        device, memory_format=torch.channels_last
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def train_row(
    batches: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
    device: torch.device,
    budget_s: float,
    warmup: int = 10,
    server: int | None = None,
) -> dict[str, Any]:
    """Images/s of ResNet-50 (bf16 autocast, channels-last) fed by ``batches()``, and the
    trainer's CPU per image: this process and its children (DataLoader's workers), less the
    sidecar ``server`` (a child here, its own container in a deployment: counted apart)."""
    model, opt = _model(device)
    me = os.getpid()

    def cpu_now() -> tuple[float, float]:
        side = tree_cpu(server) if server is not None else 0.0
        return tree_cpu(me) - side, side

    n = steps = 0
    t0 = 0.0
    c0 = (0.0, 0.0)
    for x, y in batches():
        if steps == warmup:
            sync(device)
            t0, c0, n = time.perf_counter(), cpu_now(), 0
        x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y.to(device, non_blocking=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
        n += len(y) if steps > warmup else 0
        if steps > warmup and time.perf_counter() - t0 > budget_s:
            break
    sync(device)
    dt, (cpu, side) = time.perf_counter() - t0, cpu_now()
    return {
        "steps": steps - warmup,
        "images_s": n / dt,
        "cpu_ms_per_image": 1000 * (cpu - c0[0]) / max(1, n),
        "server_cpu_ms_per_image": 1000 * (side - c0[1]) / max(1, n),
    }


def _forever(make: Callable[[int], Iterable[Any]]) -> Iterable[Any]:
    epoch = 0
    while True:
        yield from make(epoch)
        epoch += 1


def run_images(
    rep: Report, work: Path, device: torch.device, n: int, batch: int, budget_s: float
) -> None:
    store, folder = work / "img-store", work / "img-folder"
    t0 = time.perf_counter()
    write_images(store, folder, n)
    print(f"wrote {n} JPEGs in {time.perf_counter() - t0:.1f}s", flush=True)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    fake = torch.randn(batch, 3, 224, 224, device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, 100, (batch,), device=device)
    ceiling = train_row(lambda: _forever(lambda e: [(fake, labels)] * 50), device, budget_s)
    rep.row("images: decoded on the GPU (ceiling)", ceiling)

    with (
        run_server(store) as srv,
        Loader(
            srv.http_url,
            "photos",
            batch,
            seed=0,
            device=device,
            timeout=120,
            device_transforms=IMAGE_STEPS,
        ) as loader,
    ):

        def epochs(e: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
            loader.set_epoch(e)
            return ((b["image"], b["label"]) for b in loader)

        dev = train_row(lambda: _forever(epochs), device, budget_s, server=srv.proc.pid)
        dev["decode"] = loader.stats().device
    rep.row("images: shardserve device_transforms", dev)

    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    tf = transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.PILToTensor(),
        ]
    )
    dl = DataLoader(
        datasets.ImageFolder(str(folder), tf),
        batch_size=batch,
        shuffle=True,
        num_workers=8,
        pin_memory=True,
        drop_last=True,
        persistent_workers=True,
    )

    def dl_batches(e: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        for x, y in dl:
            yield (x.to(device, non_blocking=True).float() - mean) / std, y

    w8 = train_row(lambda: _forever(dl_batches), device, budget_s)
    rep.row("images: DataLoader w8 (PIL)", w8)
    c, d, w = ceiling["images_s"], dev["images_s"], w8["images_s"]
    rep.row(
        "images: ratios",
        {
            "device_vs_ceiling": d / c,
            "device_vs_dataloader_w8": d / w,
            "dataloader_w8_vs_ceiling": w / c,
            "cpu_per_image_device_vs_dataloader": dev["cpu_ms_per_image"] / w8["cpu_ms_per_image"],
            "target_met": bool((d >= 0.8 * c and d >= 2 * w) or (w >= 0.5 * c and d >= 0.9 * c)),
        },
    )


def image_smoke(rep: Report, work: Path, device: torch.device, n: int, budget_s: float) -> None:
    """The image steps end to end on ``device`` without a model: images/s and this process's
    CPU per image (a check that the path runs, not a GPU figure)."""
    store = work / "smoke-store"
    write_images(store, work / "smoke-folder", n)
    with (
        run_server(store) as srv,
        Loader(
            srv.http_url,
            "photos",
            64,
            seed=0,
            device=device,
            timeout=120,
            device_transforms=IMAGE_STEPS,
        ) as loader,
    ):
        t0, c0, count = time.perf_counter(), time.process_time(), 0
        for b in loader:  # one epoch at most, cut at the budget
            count += len(b["label"])
            if time.perf_counter() - t0 > budget_s:
                break
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        rep.row(
            f"images: device steps, no model ({device.type})",
            {
                "images_s": count / dt,
                "trainer_cpu_ms_per_image": 1000 * cpu / count,
                "decode": loader.stats().device,
            },
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small data, short budgets")
    ap.add_argument("--images", type=int, default=20_000)
    ap.add_argument("--row-budget-s", type=float, default=None, help="seconds per row")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    # The GPU run fits the device script's budget: about 3 minutes for these rows.
    budget = args.row_budget_s or (3.0 if args.quick else 20.0 if device.type == "cuda" else 30.0)
    records = 8_192 if args.quick else 65_536
    rep = Report(
        args.out,
        {
            "device": str(device),
            "quick": args.quick,
            "shogi_records": records,
            "images": args.images,
            "row_budget_s": budget,
        },
    )
    with tempfile.TemporaryDirectory(prefix="ss-bench-dev-") as tmp:
        work = args.workdir or Path(tmp)
        store = work / "store"
        if not (store / "shogi" / "manifest.json").exists():
            write_shogi(store, records)
        run_shogi(rep, store, device, 256, budget)
        why = (
            "no CUDA device"
            if device.type != "cuda"
            else "torchvision does not import"
            if _torchvision_version() is None
            else None
        )
        if why is not None:
            rep.row("images (GPU rows)", {"skipped": why})
            image_smoke(rep, work, device, 256 if args.quick else 1024, budget)
            return 0
        with contextlib.ExitStack():
            run_images(rep, work, device, 2_048 if args.quick else args.images, 256, budget)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
