"""What the mixture control-plane tests (``test_mixture_control.py``,
``test_mixture_quarantine.py``) share: the three-source mixture they create, its store, and the
HTTP calls they make (create a job, read a rank's plan, change weights, quarantine ids)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from shardserve.proto.manifest import FieldSpec
from shardserve.server.planning.mixture import MixSource, source_offsets, split_ids
from shardserve.server.store.write.writer import ShardWriter
from tests.support.data import make_cifar_like
from tests.support.server import ServerProc
from tests.support.slowness import scaled

SIZES = {"web": 6000, "code": 4000, "math": 600}
WEIGHTS = (0.5, 0.3, 0.2)
WORLD, BATCH, EPOCH_SAMPLES = 2, 50, 10_000
STEPS = EPOCH_SAMPLES // WORLD // BATCH  # 100 batches a rank
SPEC = {
    "mixture": [{"name": n, "weight": w} for n, w in zip(SIZES, WEIGHTS, strict=True)],
    "batch_size": BATCH,
    "world_size": WORLD,
    "seed": 11,
    "epoch_samples": EPOCH_SAMPLES,
}
OFFSETS = source_offsets([MixSource(n) for n in SIZES.values()])


def write_mix_store(root: Path) -> Path:
    """Three cifar-like datasets, and ``other`` whose label is int32 (does not mix)."""
    for seed, (name, n) in enumerate(SIZES.items()):
        make_cifar_like(root, name, n=n, seed=seed)
    fields = (
        FieldSpec(name="image", dtype="uint8", shape=(3, 32, 32)),
        FieldSpec(name="label", dtype="int32", shape=()),
    )
    with ShardWriter(root, "other", fields=fields) as w:
        w.add_batch(
            {"image": np.zeros((10, 3, 32, 32), np.uint8), "label": np.arange(10, dtype=np.int32)}
        )
    return root


def post_job(srv: ServerProc, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.http_url}/v1/jobs", json=body, headers=srv.headers, timeout=scaled(30))


def plan(srv: ServerProc, job: str, rank: int, epoch: int = 0) -> np.ndarray:
    r = httpx.get(
        f"{srv.http_url}/v1/jobs/{job}/plan",
        params={"epoch": epoch, "rank": rank},
        headers=srv.headers,
        timeout=scaled(60),
    )
    assert r.status_code == 200, r.text
    return np.frombuffer(r.content, dtype="<i8").reshape(STEPS, BATCH)


def global_order(ranks: list[np.ndarray]) -> np.ndarray:
    """Undo the dealing: step i of rank r holds positions (i*B + j)*W + r."""
    return np.stack([p.reshape(-1) for p in ranks], axis=1).reshape(-1)


def shares_ok(ids: np.ndarray, weights: tuple[float, ...]) -> bool:
    src, _ = split_ids(ids, OFFSETS)
    counts = np.bincount(src, minlength=len(weights))
    p = np.asarray(weights) / sum(weights)
    n = len(ids)
    return bool((np.abs(counts - n * p) <= 5 * np.sqrt(n * p * (1 - p)) + 1).all())


def put_mixture(srv: ServerProc, job: str, body: dict) -> httpx.Response:
    return httpx.put(
        f"{srv.http_url}/v1/jobs/{job}/mixture", json=body, headers=srv.headers, timeout=scaled(30)
    )


def quarantine(srv: ServerProc, dataset: str, ids: list[int], reason: str) -> httpx.Response:
    return httpx.post(
        f"{srv.http_url}/v1/datasets/{dataset}/quarantine",
        json={"ids": ids, "reason": reason},
        headers=srv.headers,
        timeout=scaled(30),
    )
