"""GPU benchmark: delivery into GPU tensors, a real model's step rate, and per-env gathers.

    python bench/bench_gpu.py [--quick] [--device cuda] [--only delivery train envs]

Needs a CUDA GPU (``--device cpu`` runs the same code on the CPU as a smoke test; its
figures mean nothing). Three parts, each with its baseline in the same run:

* ``delivery``: bytes/s delivered into GPU tensors by ``Loader(device="cuda")`` over a
  registered shared-memory ring, ipc and tcp, for 64 KiB samples (``float32[64,256]``, batch
  256) and 1 MiB samples (``float32[256,1024]``, batch 16), against pinned
  ``cudaMemcpyAsync`` of the same batch sizes (the ceiling). Target: shm >= 0.8x.
* ``train``: ResNet-18 (torchvision) on CIFAR-like ``uint8[3,32,32]`` + label, batch 256,
  AMP (bf16 autocast), channels-last, SGD, for a fixed number of steps, fed by: data already
  on the GPU (the ceiling), shardserve streaming, shardserve resident, DataLoader over a
  TensorDataset with ``num_workers`` 0 and 4 (``pin_memory``), and DataLoader over one
  ``.pt`` file per sample with ``num_workers`` 8. Targets: streaming >= 0.95x the ceiling
  with a data-stall fraction <= 5%; resident >= 0.99x.
* ``envs``: 4 environments x 32 samples a step from GPU-resident CIFAR-like data: the
  process CPU time per step of ``Loader(resident="cuda", envs=4)`` against DataLoader-based
  per-env batches (one DataLoader per env over a TensorDataset on the GPU: per-sample
  select and ``default_collate`` stack, the original hotspot), a hand-written select/stack
  loop, and in-process ``index_select`` (the floor). Target: >= 10x less CPU than DataLoader.

Prints tables and writes ``bench/results/gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from shardserve.client import Loader, serve_local
from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.write.writer import ShardWriter

RESULTS = Path(__file__).resolve().parent / "results" / "gpu.json"
#: Steps run before timing starts (cudnn autotuning, allocator, page cache, workers).
WARMUP = 20
STEPS = 0
ASSEMBLY_THREADS = min(8, os.cpu_count() or 2)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_dataset(root: Path, name: str, n: int, shape: tuple[int, ...], dtype: str) -> None:
    fields = (
        FieldSpec(name="image", dtype=dtype, shape=shape),
        FieldSpec(name="label", dtype="int64"),
    )
    rng = np.random.default_rng(0)
    with ShardWriter(root, name, fields=fields) as w:
        for start in range(0, n, 512):
            b = min(512, n - start)
            if dtype == "uint8":
                image = rng.integers(0, 256, (b, *shape), dtype=np.uint8)
            else:
                image = rng.standard_normal((b, *shape), dtype=np.float32)
            w.add_batch({"image": image, "label": np.arange(start, start + b, dtype=np.int64) % 10})


# -- delivery ------------------------------------------------------------------------------


def memcpy_ceiling(nbytes: int, batches: int, device: torch.device) -> float:
    """GB/s of pinned host -> device copies of ``nbytes`` into fresh device tensors."""
    pin = device.type == "cuda"
    src = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).fill_(i) for i in range(4)]
    for s in src:  # warm the allocator and the copy engine
        s.to(device, non_blocking=True)
    sync(device)
    t0 = time.perf_counter()
    for i in range(batches):
        src[i % 4].to(device, non_blocking=True)
    sync(device)
    return nbytes * batches / (time.perf_counter() - t0) / 1e9


def loader_gbps(url: str, name: str, batch: int, device: torch.device, transport: str) -> dict:
    with Loader(
        url,
        name,
        batch,
        seed=0,
        rank=0,
        world_size=1,
        device=str(device),
        prefetch=8,
        transport=transport,
        timeout=120,
    ) as loader:
        loader.set_epoch(0)
        for b in loader:  # warm: page cache, ring registration, pinned pool
            b["image"].sum()
        loader.set_epoch(1)
        sync(device)
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        nbytes = 0
        n = 0
        for b in loader:
            nbytes += b["image"].numel() * b["image"].element_size() + b["label"].numel() * 8
            n += 1
        sync(device)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        return {
            "gbps": nbytes / wall / 1e9,
            "client_cpu_us_per_batch": cpu / n * 1e6,
            "transport": loader.stats().transport,
        }


def bench_delivery(root: Path, quick: bool, device: torch.device) -> dict:
    cases = {
        "64k": {"n": 2048 if quick else 8192, "shape": (64, 256), "batch": 256},
        "1m": {"n": 256 if quick else 1024, "shape": (256, 1024), "batch": 16},
    }
    out: dict = {}
    for name, c in cases.items():
        write_dataset(root, name, c["n"], c["shape"], "float32")
    with serve_local(root, "--assembly-threads", str(ASSEMBLY_THREADS)) as url:
        for name, c in cases.items():
            nbytes = c["batch"] * (int(np.prod(c["shape"])) * 4 + 8)
            ceiling = memcpy_ceiling(nbytes, max(32, c["n"] // c["batch"]), device)
            rows = {"pinned memcpy (ceiling)": {"gbps": ceiling}}
            for transport in ("auto", "ipc", "tcp"):
                r = loader_gbps(url, name, c["batch"], device, transport)
                rows[f"shardserve {r['transport']}"] = r
            for r in rows.values():
                r["ratio"] = r["gbps"] / ceiling
            out[name] = rows
            print(
                f"\n{name} samples, batch {c['batch']} ({nbytes / 2**20:.1f} MiB a batch) into {device}"
            )
            for k, r in rows.items():
                cpu = r.get("client_cpu_us_per_batch")
                extra = f"  client CPU {cpu:7.0f} us/batch" if cpu is not None else ""
                print(f"  {k:28s} {r['gbps']:7.2f} GB/s  {r['ratio']:5.2f}x{extra}")
            shm = rows.get("shardserve shm", {}).get("ratio", 0.0)
            print(f"  target shm >= 0.8x ceiling: {'met' if shm >= 0.8 else 'missed'} ({shm:.2f}x)")
    return out


# -- train ---------------------------------------------------------------------------------


class PtFiles(Dataset):
    """One ``.pt`` file per sample, read with ``torch.load(weights_only=True)``."""

    def __init__(self, folder: Path, n: int) -> None:
        self.folder, self.n = folder, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return torch.load(self.folder / f"{i:06d}.pt", weights_only=True)


def make_model(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    try:
        import torchvision

        model: torch.nn.Module = torchvision.models.resnet18(num_classes=10)
    except ImportError:  # smoke tests where torchvision has no build (this CPU machine)
        print("  (torchvision missing: a small CNN stands in for ResNet-18)")
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, 2),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(16 * 15 * 15, 10),
        )
    model = model.to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


MEAN = torch.tensor([0.49, 0.48, 0.45]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.25, 0.24, 0.26]).view(1, 3, 1, 1) * 255


def train_steps(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], steps: int, device: torch.device
) -> tuple[float, int]:
    """Train for ``steps`` batches after ``WARMUP`` steps; returns (seconds, samples)."""
    model, opt = make_model(device)
    mean, std = MEAN.to(device), STD.to(device)
    loss_fn = torch.nn.CrossEntropyLoss()
    dtype = torch.bfloat16
    it = iter(batches)
    t0 = 0.0
    samples = 0
    for step in range(steps + WARMUP):
        if step == WARMUP:
            sync(device)
            t0 = time.perf_counter()
            samples = 0
        image, label = next(it)
        image = image.to(device, non_blocking=True)
        label = label.to(device, non_blocking=True)
        x = ((image.float() - mean) / std).contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=dtype):
            loss = loss_fn(model(x), label)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        samples += len(label)
    sync(device)
    return time.perf_counter() - t0, samples


def forever(make_epoch: Callable[[int], Iterable]) -> Iterable:
    epoch = 0
    while True:
        yield from make_epoch(epoch)
        epoch += 1


def bench_train(root: Path, quick: bool, device: torch.device) -> dict:
    n = 8192 if quick else 50_000
    steps = STEPS or (40 if quick else 400)
    bs = 256
    write_dataset(root, "cifar", n, (3, 32, 32), "uint8")
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8))
    labels = torch.arange(n, dtype=torch.int64) % 10
    pt_dir = root / "pt"
    pt_dir.mkdir(exist_ok=True)
    for i in range(n):
        torch.save({"image": images[i].clone(), "label": labels[i].clone()}, pt_dir / f"{i:06d}.pt")
    rows: dict[str, dict] = {}

    def record(name: str, seconds: float, samples: int, **extra: float) -> None:
        # Each GPU configuration runs twice, interleaved with the others: keep the better run
        # (the VM's noise only ever slows a run down) and both figures.
        rate = samples / seconds
        old = rows.get(name)
        runs = [*old["runs"], rate] if old else [rate]
        if old is None or rate > old["samples_per_s"]:
            rows[name] = {"samples_per_s": rate, **extra}
        rows[name]["runs"] = runs

    gi, gl = images.to(device), labels.to(device)

    def on_gpu(epoch: int) -> Iterable:
        g = torch.Generator(device="cpu").manual_seed(epoch)
        perm = torch.randperm(n, generator=g).to(device)
        for i in range(n // bs):
            idx = perm[i * bs : (i + 1) * bs]
            yield gi.index_select(0, idx), gl.index_select(0, idx)

    with serve_local(root, "--assembly-threads", str(ASSEMBLY_THREADS)) as url:
        for mode, kw in (
            ("ceiling", {}),
            ("streaming", {}),
            ("resident", {"resident": device.type}),
        ) * 2:
            if mode == "ceiling":
                record("data on the GPU (ceiling)", *train_steps(forever(on_gpu), steps, device))
                continue
            with Loader(
                url,
                "cifar",
                bs,
                seed=0,
                rank=0,
                world_size=1,
                device=str(device),
                prefetch=8,
                drop_last=True,
                **kw,
            ) as loader:

                def epochs(epoch: int, loader: Loader = loader) -> Iterable:
                    loader.set_epoch(epoch)
                    for b in loader:
                        yield b["image"], b["label"]

                before = loader.stats()
                seconds, samples = train_steps(forever(epochs), steps, device)
                after = loader.stats()
                wait = after.wait_s - before.wait_s
                compute = after.compute_s - before.compute_s
                record(
                    f"shardserve {mode}", seconds, samples, stall=wait / max(wait + compute, 1e-9)
                )

    ds = TensorDataset(images, labels)
    for workers in (0, 4):
        dl = DataLoader(
            ds,
            batch_size=bs,
            shuffle=True,
            drop_last=True,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            persistent_workers=workers > 0,
        )
        record(
            f"DataLoader TensorDataset workers={workers}",
            *train_steps(forever(lambda _e, dl=dl: iter(dl)), steps, device),
        )
    dl = DataLoader(
        PtFiles(pt_dir, n),
        batch_size=bs,
        shuffle=True,
        drop_last=True,
        num_workers=8,
        pin_memory=device.type == "cuda",
        persistent_workers=True,
    )
    record(
        "DataLoader .pt per sample workers=8",
        *train_steps(forever(lambda _e: ((b["image"], b["label"]) for b in dl)), steps, device),
    )

    ceiling = rows["data on the GPU (ceiling)"]["samples_per_s"]
    print(
        f"\nResNet-18, CIFAR-like {n} samples, batch {bs}, bf16 autocast, {steps} timed steps on {device}"
    )
    for k, r in rows.items():
        r["ratio"] = r["samples_per_s"] / ceiling
        stall = f"  stall {r['stall']:.3f}" if "stall" in r else ""
        runs = "  runs " + ", ".join(f"{x:,.0f}" for x in r["runs"]) if len(r["runs"]) > 1 else ""
        print(f"  {k:40s} {r['samples_per_s']:10,.0f} samples/s  {r['ratio']:5.2f}x{stall}{runs}")
    s, res = rows["shardserve streaming"], rows["shardserve resident"]
    ok_s = s["ratio"] >= 0.95 and s["stall"] <= 0.05
    print(
        f"  target streaming >= 0.95x, stall <= 5%: {'met' if ok_s else 'missed'} "
        f"({s['ratio']:.2f}x, {s['stall']:.1%})"
    )
    print(
        f"  target resident >= 0.99x: {'met' if res['ratio'] >= 0.99 else 'missed'} ({res['ratio']:.2f}x)"
    )
    return rows


# -- envs ----------------------------------------------------------------------------------


def cpu_per_step(steps: Iterable, count: int, device: torch.device) -> dict:
    it = iter(steps)
    for _ in range(WARMUP):
        next(it)
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(count):
        envs = next(it)
        assert len({b["image"].untyped_storage().data_ptr() for b in envs}) == len(envs), "aliasing"
    sync(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"cpu_us_per_step": cpu / count * 1e6, "steps_per_s": count / wall}


def bench_envs(root: Path, quick: bool, device: torch.device) -> dict:
    n, n_envs, bs = 50_000 if not quick else 8192, 4, 32
    count = STEPS or (300 if quick else 2000)
    if not (root / "cifar").exists():
        write_dataset(root, "cifar", n, (3, 32, 32), "uint8")
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)).to(device)
    labels = (torch.arange(n, dtype=torch.int64) % 10).to(device)
    rows: dict[str, dict] = {}

    def dataloaders(_epoch: int) -> Iterable:
        dls = [
            DataLoader(
                TensorDataset(images, labels),
                batch_size=bs,
                shuffle=True,
                drop_last=True,
                generator=torch.Generator().manual_seed(e),
            )
            for e in range(n_envs)
        ]
        for batches in zip(*dls, strict=False):
            yield [{"image": b[0], "label": b[1]} for b in batches]

    def select_stack(epoch: int) -> Iterable:
        perms = [
            torch.randperm(n, generator=torch.Generator().manual_seed(epoch * 10 + e)).tolist()
            for e in range(n_envs)
        ]
        for i in range(n // bs):
            yield [
                {
                    "image": torch.stack([images[j] for j in p[i * bs : (i + 1) * bs]]),
                    "label": torch.stack([labels[j] for j in p[i * bs : (i + 1) * bs]]),
                }
                for p in perms
            ]

    def index_select(epoch: int) -> Iterable:
        perms = [
            torch.randperm(n, generator=torch.Generator().manual_seed(epoch * 10 + e)).to(device)
            for e in range(n_envs)
        ]
        for i in range(n // bs):
            yield [
                {
                    "image": images.index_select(0, p[i * bs : (i + 1) * bs]),
                    "label": labels.index_select(0, p[i * bs : (i + 1) * bs]),
                }
                for p in perms
            ]

    rows["DataLoader per env (select + collate)"] = cpu_per_step(
        forever(dataloaders), count, device
    )
    rows["select/stack loop per env"] = cpu_per_step(forever(select_stack), count, device)
    rows["in-process index_select (floor)"] = cpu_per_step(forever(index_select), count, device)
    with (
        serve_local(root) as url,
        Loader(
            url,
            "cifar",
            bs,
            seed=0,
            rank=0,
            world_size=1,
            resident=device.type,
            envs=n_envs,
            drop_last=True,
        ) as loader,
    ):

        def epochs(epoch: int) -> Iterable:
            loader.set_epoch(epoch)
            yield from loader

        rows["shardserve resident envs=4"] = cpu_per_step(forever(epochs), count, device)
    base = rows["DataLoader per env (select + collate)"]["cpu_us_per_step"]
    print(f"\n{n_envs} envs x {bs} samples a step, GPU-resident data on {device}")
    for k, r in rows.items():
        r["cpu_vs_dataloader"] = base / r["cpu_us_per_step"]
        print(
            f"  {k:40s} {r['cpu_us_per_step']:9.1f} us CPU/step  {r['steps_per_s']:9,.0f} steps/s  "
            f"{r['cpu_vs_dataloader']:6.1f}x less CPU"
        )
    ours = rows["shardserve resident envs=4"]["cpu_vs_dataloader"]
    print(
        f"  target >= 10x less CPU than DataLoader: {'met' if ours >= 10 else 'missed'} ({ours:.1f}x)"
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    global STEPS, WARMUP
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--only", nargs="*", default=["delivery", "train", "envs"])
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--steps", type=int, default=0, help="override the timed steps (smoke tests)")
    p.add_argument("--warmup", type=int, default=WARMUP)
    args = p.parse_args(argv)
    STEPS, WARMUP = args.steps, args.warmup
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "bench_gpu: no CUDA GPU here; run it on a GPU machine (or --device cpu to smoke-test)"
        )
        return 0
    results: dict = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "quick": args.quick,
    }
    with tempfile.TemporaryDirectory(prefix="ss-bench-gpu-", dir=args.workdir) as tmp:
        root = Path(tmp)
        parts = {"delivery": bench_delivery, "train": bench_train, "envs": bench_envs}
        for name in args.only:
            t0 = time.perf_counter()
            results[name] = parts[name](root, args.quick, device)
            print(f"--- {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
