"""``shardserve demo``: the whole path on a fresh machine, in one command.

Ingests scikit-learn's digits into a store (a temporary one by default), starts the server
with :func:`serve_local`, trains a small CNN through :class:`Loader` with a progress bar,
then trains the same model from a plain ``torch.utils.data.DataLoader`` over the same
tensors, and prints accuracy, samples/s and data-stall fraction side by side.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .loader import Loader
from .local import serve_local

TRAIN, TEST = "digits-train", "digits-test"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip


def _digits(seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(
            "the demo trains on scikit-learn's digits: pip install scikit-learn"
        ) from None
    d = load_digits()
    image, label = (d.images.astype(np.float32) / 16.0)[:, None], d.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(label))
    cut = int(0.8 * len(label))
    return {
        TRAIN: {"image": image[order[:cut]], "label": label[order[:cut]]},
        TEST: {"image": image[order[cut:]], "label": label[order[cut:]]},
    }


def _ingest(store: Path, data: dict[str, dict[str, np.ndarray]], work: Path) -> None:
    # A subprocess, so that the client never imports pyarrow.
    for name, arrays in data.items():
        if (store / name / "manifest.json").exists():
            continue
        src = work / f"{name}.npz"
        np.savez(src, **arrays)  # type: ignore[arg-type]
        cmd = [
            sys.executable,
            "-m",
            "shardserve.server",
            "ingest",
            str(src),
            "--store",
            str(store),
            "--name",
            name,
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise SystemExit(f"ingest of {name} failed ({' '.join(cmd)}):\n{r.stdout}{r.stderr}")


def _progress(it: Iterable, total: int, desc: str) -> Iterable:
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, total=total, desc=desc, leave=False)


def _train(
    batches_of_epoch: Iterator[Iterable[tuple[torch.Tensor, torch.Tensor]]],
    epochs: int,
    per_epoch: int,
    label: str,
) -> tuple[nn.Module, dict[str, float]]:
    """Train for ``epochs``; returns the model and samples/s, wait and compute seconds."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    wait = compute = 0.0
    samples = 0
    start = time.perf_counter()
    for epoch in range(epochs):
        it = iter(_progress(next(batches_of_epoch), per_epoch, f"{label} epoch {epoch}"))
        while True:
            t0 = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            t1 = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            wait += t1 - t0
            compute += time.perf_counter() - t1
            samples += len(y)
    elapsed = time.perf_counter() - start
    return model, {"samples_s": samples / elapsed, "stall": wait / max(1e-9, wait + compute)}


@torch.no_grad()
def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model.eval()(x).argmax(1) == y).float().mean())


def run_demo(epochs: int = 3, batch_size: int = 64, store: str | Path | None = None) -> int:
    """Run the demo; returns the process exit code (0 on success).

    >>> run_demo(epochs=1)   # doctest: +SKIP
    """
    data = _digits()
    test_x, test_y = torch.from_numpy(data[TEST]["image"]), torch.from_numpy(data[TEST]["label"])
    with tempfile.TemporaryDirectory(prefix="ss-demo-") as tmp:
        root = Path(store) if store is not None else Path(tmp) / "store"
        root.mkdir(parents=True, exist_ok=True)
        print(f"ingesting digits into {root} ...", flush=True)
        _ingest(root, data, Path(tmp))
        with serve_local(root) as url:
            print(f"server up at {url}", flush=True)
            with Loader(url, TRAIN, batch_size, seed=0) as loader:

                def shardserve_epochs() -> Iterator[Iterable[tuple[torch.Tensor, torch.Tensor]]]:
                    for e in range(epochs):
                        loader.set_epoch(e)
                        yield ((b["image"], b["label"]) for b in loader)  # type: ignore[misc]

                model, ours = _train(shardserve_epochs(), epochs, len(loader), "shardserve")
                ours["acc"] = _accuracy(model, test_x, test_y)
                ours["loader_stall"] = loader.stats().stall_fraction
        dataset = torch.utils.data.TensorDataset(
            torch.from_numpy(data[TRAIN]["image"]), torch.from_numpy(data[TRAIN]["label"])
        )
        gen = torch.Generator().manual_seed(0)
        dl = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, shuffle=True, num_workers=0, generator=gen
        )
        model, theirs = _train(iter([dl] * epochs), epochs, len(dl), "DataLoader")
        theirs["acc"] = _accuracy(model, test_x, test_y)
    print(f"\n{'':28}{'accuracy':>10}{'samples/s':>12}{'stall':>8}")
    print(
        f"{'shardserve Loader':28}{ours['acc']:>10.3f}{ours['samples_s']:>12.0f}{ours['stall']:>8.3f}"
    )
    print(
        f"{'DataLoader (workers=0)':28}{theirs['acc']:>10.3f}{theirs['samples_s']:>12.0f}{theirs['stall']:>8.3f}"
    )
    print(
        f"\n{epochs} epochs of {len(data[TRAIN]['label'])} digits, batch {batch_size}; "
        f"held-out accuracy on {len(test_y)} samples. Server stopped, store {'kept' if store else 'removed'}."
    )
    return 0
