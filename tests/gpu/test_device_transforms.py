"""``device_transforms`` on a real GPU: nvJPEG decode beside the Pillow path, exact bit
unpacking, fallbacks counted, pinned staging bounded, fresh storage per batch.

Tolerance against the CPU path (Pillow's full decode, the same boxes and resampler): nvJPEG
and libjpeg differ by themselves (IDCT, chroma upsampling), so pixels agree within mean abs
difference 2.0 and max abs difference 64 on uint8; PNGs (decoded by Pillow on the CPU as a
counted fallback) and ``unpack_bits`` agree exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from shardserve.client import Loader
from shardserve.client.device_steps import MAX_STAGED
from shardserve.server.store.write.writer import ShardWriter
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled
from tests.transforms.test_device_transforms import (
    BIT_FIELDS,
    DECODE_CROP,
    PHOTO_FIELDS,
    PHOTOS,
    UNPACK,
    _photo,
)

pytestmark = pytest.mark.cuda
BATCH = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("gpu-dev")
    with ShardWriter(root, "photos", fields=PHOTO_FIELDS, shard_bytes=64 << 10) as w:
        for i in range(PHOTOS):
            w.add({"image": _photo(i), "label": np.int64(i)})
    bits = np.random.default_rng(5).integers(0, 256, (80, 13), dtype=np.uint8)
    with ShardWriter(root, "bits", fields=BIT_FIELDS, shard_bytes=16 << 10) as w:
        w.add_batch({"board": bits, "label": np.arange(80, dtype=np.int64)})
    with run_server(root) as srv:
        yield srv


def _epoch(srv: ServerProc, dataset: str, device: str, **kw: Any) -> tuple[list[dict], Any]:
    with Loader(
        srv.http_url, dataset, BATCH, seed=3, device=device, timeout=scaled(60), **kw
    ) as loader:
        loader.set_epoch(1)
        got = [dict(b) for b in loader]
        return got, loader.stats().device


def test_gpu_decode_agrees_with_the_cpu_path(server: ServerProc) -> None:
    """nvJPEG + device crop/flip on cuda agree with the Pillow path on cpu within tolerance."""
    cpu, _ = _epoch(server, "photos", "cpu", device_transforms=DECODE_CROP)
    gpu, stats = _epoch(server, "photos", "cuda", device_transforms=DECODE_CROP)
    diffs = []
    for a, b in zip(cpu, gpu, strict=True):
        assert b["image"].is_cuda and torch.equal(a["label"], b["label"].cpu())
        diffs.append((a["image"].int() - b["image"].cpu().int()).abs().flatten())
    d = torch.cat(diffs)
    assert float(d.float().mean()) <= 2.0 and int(d.max()) <= 64, (
        float(d.float().mean()),
        int(d.max()),
    )
    pngs = sum(1 for i in range(PHOTOS) if i % 9 == 0)
    if stats["decoder"] == "nvjpeg":
        assert stats["device_decodes"] == PHOTOS - pngs and stats["cpu_fallback_decodes"] == pngs
    assert stats["staging_blocks"] <= MAX_STAGED


def test_unpack_bits_exact_on_gpu(server: ServerProc) -> None:
    """Bits unpacked on the GPU equal the server's unpack_bits exactly."""
    cpu, _ = _epoch(server, "bits", "cpu", transforms=UNPACK)
    gpu, _ = _epoch(server, "bits", "cuda", device_transforms=UNPACK)
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a["board"], b["board"].cpu())


def test_staging_stays_bounded_and_batches_own_storage(server: ServerProc) -> None:
    """Over several epochs the pinned blocks stay at most MAX_STAGED and no two kept batches
    share device storage."""
    with Loader(
        server.http_url,
        "photos",
        BATCH,
        seed=1,
        device="cuda",
        timeout=scaled(60),
        device_transforms=DECODE_CROP,
    ) as loader:
        kept = []
        for e in range(3):
            loader.set_epoch(e)
            kept += [b["image"] for b in loader]
        torch.cuda.synchronize()
        assert loader.stats().device["staging_blocks"] <= MAX_STAGED
    ptrs = {t.untyped_storage().data_ptr() for t in kept}
    assert len(ptrs) == len(kept)
