"""``shardserve demo``: the situation shardserve exists for, measured on this machine.

Most datasets people bring are a folder of small files, one ``.pt`` per sample, read by a
``Dataset`` whose ``__getitem__`` calls ``torch.load``. The demo writes scikit-learn's digits
(shifted copies too, so there are a few thousand) as such a folder, then trains one small
model three ways with the same loop:

1. ``DataLoader`` over the folder, ``num_workers=0``;
2. the same with ``num_workers=2`` (forked workers, what users reach for next);
3. the folder ingested once with ``shardserve ingest`` and served by a local server,
   read through :class:`Loader`.

The model is small enough that input is the bottleneck, as with a small model on a fast
GPU. It prints samples/s, the fraction of loop time spent waiting for data, and how many
times faster shardserve fed the loop, then the held-out accuracy of the short training run
through the Loader. Every figure is measured here, in this run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .loader import Loader
from .local import serve_local

TRAIN = "digits-pt"
#: Pixel shifts applied to each training digit: more samples, the same task.
SHIFTS = ((0, 0), (1, 1))


class PtFolder(torch.utils.data.Dataset):
    """One sample per ``.pt`` file, loaded on every access: the usual custom Dataset."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        sample = torch.load(self.files[i], weights_only=True)
        return sample["image"], sample["label"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16 * 16, 64), nn.ReLU(), nn.Linear(64, 10))


def _digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Train images (shifted copies included) and labels, then held-out ones; 16x16 float32."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(
            "the demo trains on scikit-learn's digits: pip install scikit-learn"
        ) from None
    d = load_digits()
    images = np.kron(d.images.astype(np.float32) / 16.0, np.ones((2, 2), np.float32))[:, None]
    labels = d.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    shifted = [np.roll(images[train], (dy, dx), axis=(2, 3)) for dy, dx in SHIFTS]
    train_x = np.concatenate(shifted)
    train_y = np.tile(labels[train], len(SHIFTS))
    return train_x, train_y, images[test], labels[test]


def _write_pt_folder(folder: Path, x: np.ndarray, y: np.ndarray) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(len(y)):
        path = folder / f"{i:06d}.pt"
        if not path.exists():
            sample = {"image": torch.from_numpy(x[i]), "label": torch.tensor(y[i])}
            torch.save(sample, path)
        files.append(path)
    return files


def _ingest(store: Path, folder: Path) -> float:
    """``shardserve ingest`` in a subprocess (the client never imports pyarrow); seconds."""
    if (store / TRAIN / "manifest.json").exists():
        return 0.0
    cmd = [
        sys.executable,
        "-m",
        "shardserve.server",
        "ingest",
        str(folder),
        "--store",
        str(store),
        "--name",
        TRAIN,
        "--quiet",
    ]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"ingest failed ({' '.join(cmd)}):\n{r.stdout}{r.stderr}")
    return time.perf_counter() - t0


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[int, float, float]:
    """One pass of the training loop; returns samples, seconds waiting for data, computing."""
    it = iter(batches)
    samples, wait, compute = 0, 0.0, 0.0
    while True:
        t0 = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            wait += time.perf_counter() - t0
            return samples, wait, compute
        t1 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        compute += time.perf_counter() - t1
        wait += t1 - t0
        samples += len(y)


def _run(epoch_batches: Iterable[Iterable[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, Any]:
    """Train a fresh model over each epoch's batches; rate, stall fraction and the model."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    samples, wait, compute = 0, 0.0, 0.0
    for batches in epoch_batches:
        n, w, c = _train(model, opt, batches)
        samples, wait, compute = samples + n, wait + w, compute + c
    return {
        "samples_s": samples / (wait + compute),
        "stall": wait / (wait + compute),
        "model": model,
    }


@torch.no_grad()
def _accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    pred = model.eval()(torch.from_numpy(x)).argmax(1)
    return float((pred == torch.from_numpy(y)).float().mean())


def run_demo(epochs: int = 3, batch_size: int = 64, store: str | Path | None = None) -> int:
    """Run the demo; returns the process exit code (0 on success).

    Each DataLoader row is one epoch over the folder (forked workers started as in any
    epoch); the shardserve row is the ``epochs`` epochs of the training run whose accuracy
    is printed.

    >>> run_demo(epochs=1)   # doctest: +SKIP
    """
    # A model this small runs fastest on one thread; more only contend with the data path.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _demo(epochs, batch_size, store)
    finally:
        torch.set_num_threads(threads)


def _demo(epochs: int, batch_size: int, store: str | Path | None) -> int:
    train_x, train_y, test_x, test_y = _digits()
    n = len(train_y)
    gen = torch.Generator().manual_seed(0)
    rows: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="ss-demo-") as tmp:
        root = Path(store) if store is not None else Path(tmp) / "store"
        folder = Path(tmp) / TRAIN
        print(f"writing {n} digits as one .pt file each under {folder} ...", flush=True)
        files = _write_pt_folder(folder, train_x, train_y)
        for workers in (0, 2):
            dl = torch.utils.data.DataLoader(
                PtFolder(files),
                batch_size=batch_size,
                shuffle=True,
                num_workers=workers,
                generator=gen,
            )
            label = f"DataLoader(.pt files, workers={workers})"
            print(f"training one epoch through {label} ...", flush=True)
            rows.append((label, _run([dl])))
        root.mkdir(parents=True, exist_ok=True)
        ingest_s = _ingest(root, folder)
        if ingest_s:
            print(f"ingested the folder into {root} in {ingest_s:.1f} s (once)", flush=True)
        else:
            print(f"{TRAIN} is already in {root}: not ingested again", flush=True)
        with serve_local(root) as url, Loader(url, TRAIN, batch_size, seed=0) as loader:
            print(
                f"server up at {url}; training {epochs} epochs through the Loader ...", flush=True
            )

            def epoch_batches() -> Iterable[Iterable[tuple[torch.Tensor, torch.Tensor]]]:
                for e in range(epochs):
                    loader.set_epoch(e)
                    yield ((b["image"], b["label"]) for b in loader)

            ours = _run(epoch_batches())
            transport = loader.stats().transport
    ours["acc"] = _accuracy(ours["model"], test_x, test_y)
    _report(rows, ours, transport, epochs, n, batch_size, len(test_y), ingest_s, store)
    return 0


def _report(
    rows: list[tuple[str, dict[str, Any]]],
    ours: dict[str, Any],
    transport: str,
    epochs: int,
    n: int,
    batch_size: int,
    n_test: int,
    ingest_s: float,
    store: str | Path | None,
) -> None:
    print(f"\n{'':38}{'samples/s':>10}{'stall':>7}  shardserve faster by")
    for label, r in rows:
        ratio = ours["samples_s"] / r["samples_s"]
        print(f"{label:38}{r['samples_s']:>10.0f}{r['stall']:>7.2f}  {ratio:.1f}x")
    print(
        f"{'shardserve Loader (' + transport + ')':38}{ours['samples_s']:>10.0f}{ours['stall']:>7.2f}"
    )
    print(
        f"\nheld-out accuracy after {epochs} epochs through the Loader: {ours['acc']:.3f} "
        f"({n_test} digits never trained on)"
    )
    print(
        f"What this measures: how fast one training loop, with a model too small to hide input "
        f"(as on a fast GPU), is fed {n} samples of {batch_size} on this machine's "
        f"{os.cpu_count()} cores from a warm page cache; ingest ({ingest_s:.1f} s, once) and "
        f"server start-up are not in the shardserve row. Store {'kept' if store else 'removed'}."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shardserve.client.demo`` (also ``shardserve demo``): parse flags, run."""
    import argparse

    p = argparse.ArgumentParser(
        prog="shardserve demo",
        description="End-to-end demo on a fresh machine (needs the client extra: torch).",
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--store", default=None, help="store folder (default: a temporary one)")
    args = p.parse_args(argv)
    return run_demo(epochs=args.epochs, batch_size=args.batch_size, store=args.store)


if __name__ == "__main__":
    sys.exit(main())
