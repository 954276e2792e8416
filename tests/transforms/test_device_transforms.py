"""``device_transforms`` end to end on ``cpu``: a real server draws the parameters, a Loader
executes the steps, and the result equals the server's own chain of the same steps.

Tolerance of the pixels: on the CPU the device path decodes with Pillow at full size (no
draft scaling) and resamples with the server's ``method="numpy"`` bilinear arithmetic, so
it must equal the server's ``decode_image`` + ``random_resized_crop(method="numpy")`` within
max abs difference 1 and mean abs difference 0.01 (measured: 0 and 0); crops, flips and
``unpack_bits`` exactly.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shardserve.client import Loader
from shardserve.client.device_steps import MAX_STAGED
from shardserve.proto.errors import BadRequest, TransformError
from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.write.writer import ShardWriter
from tests.support.data import make_cifar_like
from tests.support.resume import assert_resumes_exactly
from tests.support.server import ServerProc, free_port, run_server
from tests.support.slowness import scaled
from tests.transforms.conftest import digest

PIL = pytest.importorskip("PIL.Image")
BATCH = 16
PHOTOS, BITS = 72, 80
PHOTO_FIELDS = (FieldSpec(name="image", dtype="binary"), FieldSpec(name="label", dtype="int64"))
BIT_FIELDS = (
    FieldSpec(name="board", dtype="uint8", shape=(13,)),
    FieldSpec(name="label", dtype="int64"),
)
CROP_FLIP = [
    {"name": "random_crop", "params": {"size": 32, "padding": 4, "layout": "CHW"}},
    {"name": "hflip", "params": {"layout": "CHW"}},
]
DECODE_CROP = [
    {"name": "decode_image"},
    {"name": "random_resized_crop", "params": {"size": [20, 24]}},
    {"name": "hflip"},
]
UNPACK = [
    {"name": "unpack_bits", "params": {"field": "board", "shape": [2, 50], "dtype": "float32"}}
]


def _photo(i: int) -> bytes:
    rng = np.random.default_rng(i)
    h, w = 24 + (i * 7) % 41, 24 + (i * 11) % 47
    a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.fromarray(a).save(buf, format="PNG" if i % 9 == 0 else "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("devstore")
    make_cifar_like(root, n=200)
    with ShardWriter(root, "photos", fields=PHOTO_FIELDS, shard_bytes=64 << 10) as w:
        for i in range(PHOTOS):
            w.add({"image": _photo(i), "label": np.int64(i)})
    with ShardWriter(root, "broken", fields=PHOTO_FIELDS) as w:
        for i in range(20):
            w.add({"image": b"not an image" if i == 7 else _photo(i), "label": np.int64(i)})
    bits = np.random.default_rng(5).integers(0, 256, (BITS, 13), dtype=np.uint8)
    with ShardWriter(root, "bits", fields=BIT_FIELDS, shard_bytes=16 << 10) as w:
        w.add_batch({"board": bits, "label": np.arange(BITS, dtype=np.int64)})
    return root


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProc]:
    with run_server(store) as srv:
        yield srv


def _epoch(srv: ServerProc, dataset: str, epoch: int = 1, **kw: Any) -> list[dict[str, Any]]:
    with Loader(srv.http_url, dataset, BATCH, seed=3, timeout=scaled(30), **kw) as loader:
        loader.set_epoch(epoch)
        return [dict(b) for b in loader]


def test_crop_and_flip_equal_the_server_chain(server: ServerProc) -> None:
    """Offsets and flips the server ships are those its own random_crop and hflip draw: equal bytes."""
    cpu = _epoch(server, "cifar", transforms=CROP_FLIP)
    dev = _epoch(server, "cifar", device_transforms=CROP_FLIP)
    assert len(cpu) == len(dev) == 13
    for a, b in zip(cpu, dev, strict=True):
        assert set(b) == {"image", "label"}
        assert torch.equal(a["label"], b["label"])
        assert torch.equal(a["image"], b["image"])


def test_decode_and_resized_crop_within_tolerance(server: ServerProc) -> None:
    """Decode + random resized crop + flip on cpu equal the server's full decode and resampler."""
    ref = [*DECODE_CROP]
    ref[1] = {"name": "random_resized_crop", "params": {"size": [20, 24], "method": "numpy"}}
    cpu = _epoch(server, "photos", transforms=ref)
    with Loader(
        server.http_url, "photos", BATCH, seed=3, timeout=scaled(30), device_transforms=DECODE_CROP
    ) as loader:
        loader.set_epoch(1)
        dev = [dict(b) for b in loader]
        stats = loader.stats().device
    diffs = [(a["image"].int() - b["image"].int()).abs() for a, b in zip(cpu, dev, strict=True)]
    assert all(torch.equal(a["label"], b["label"]) for a, b in zip(cpu, dev, strict=True))
    worst = max(int(d.max()) for d in diffs)
    mean = float(torch.cat([d.flatten() for d in diffs]).float().mean())
    assert worst <= 1 and mean <= 0.01, (worst, mean)
    assert dev[0]["image"].shape == (BATCH, 20, 24, 3) and dev[0]["image"].dtype == torch.uint8
    assert stats is not None and stats["cpu_decodes"] == PHOTOS and stats["decoder"] == "pillow"
    assert stats["staging_blocks"] <= MAX_STAGED


def test_unpack_bits_exact(server: ServerProc) -> None:
    """Packed records unpacked on the device equal the server's unpack_bits bit for bit."""
    cpu = _epoch(server, "bits", transforms=UNPACK)
    dev = _epoch(server, "bits", device_transforms=UNPACK)
    for a, b in zip(cpu, dev, strict=True):
        assert b["board"].shape == (len(b["label"]), 2, 50)
        assert torch.equal(a["board"], b["board"])


def test_resume_mid_epoch_is_exact(server: ServerProc) -> None:
    """state_dict mid-epoch and load_state_dict in a new Loader give the rest byte for byte."""

    def make_iter(state: object) -> tuple:
        loader = Loader(
            server.http_url,
            "photos",
            BATCH,
            seed=3,
            timeout=scaled(30),
            device_transforms=DECODE_CROP,
        )
        if state is not None:
            loader.load_state_dict(state)
        else:
            loader.set_epoch(2)
        return iter(loader), loader.state_dict

    assert_resumes_exactly(make_iter, midpoint=2, key=digest)


def test_restart_gives_the_same_bytes(store: Path, server: ServerProc) -> None:
    """A new server process on the same store draws the same parameters for the same job."""
    first = _epoch(server, "photos", epoch=4, device_transforms=DECODE_CROP)
    with run_server(store) as other:
        again = _epoch(other, "photos", epoch=4, device_transforms=DECODE_CROP)
    assert [digest(b) for b in first] == [digest(b) for b in again]
    other_epoch = _epoch(server, "photos", epoch=5, device_transforms=DECODE_CROP)
    assert [digest(b) for b in first] != [digest(b) for b in other_epoch]


@pytest.mark.parametrize(
    ("steps", "says"),
    [
        ([{"name": "decode_image", "params": {"field": "label"}}], "not encoded bytes"),
        ([{"name": "random_crop", "params": {"size": 8}}], "decode_image it first"),
        ([{"name": "hflip", "params": {"field": "nope"}}], "no field 'nope'"),
    ],
)
def test_steps_that_do_not_fit_are_refused(server: ServerProc, steps: list, says: str) -> None:
    """A device step that does not fit the served fields is a 422 naming the step."""
    with pytest.raises(BadRequest, match=f"device_transforms\\[0\\].*{says}"):
        Loader(server.http_url, "photos", BATCH, timeout=scaled(30), device_transforms=steps)


def test_fields_subset_still_carries_the_parameters(server: ServerProc) -> None:
    """With fields=[...] the drawn parameters travel anyway and the steps see them."""
    full = _epoch(server, "cifar", device_transforms=CROP_FLIP)
    only = _epoch(server, "cifar", device_transforms=CROP_FLIP, fields=["image"])
    assert [set(b) for b in only] == [{"image"}] * len(full)
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(full, only, strict=True))


def test_an_unreadable_header_fails_naming_the_sample(server: ServerProc) -> None:
    """Bytes that are no image fail the job with TransformError naming the sample and field."""
    with pytest.raises(TransformError, match="'image' of sample 7"):
        _epoch(server, "broken", device_transforms=DECODE_CROP, shuffle=False)


def test_same_bytes_across_a_kill9_restart(store: Path, tmp_path: Path) -> None:
    """A Loader with device steps reading an epoch across a kill -9 of its server gets exactly
    the batches of an uninterrupted run."""
    http, data = free_port(), free_port()
    args = ("--state-dir", str(tmp_path / "state"))
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(
            run_server(store, *args, http_port=http, data_port=data, workdir=tmp_path / "w")
        )
        ref = [digest(b) for b in _epoch(srv, "photos", epoch=2, device_transforms=DECODE_CROP)]
        got: list[str] = []
        # ipc: a ring of a killed server is removed by the next one only once no client maps it.
        with Loader(
            srv.http_url,
            "photos",
            BATCH,
            seed=3,
            timeout=scaled(30),
            prefetch=2,
            transport="ipc",
            device_transforms=DECODE_CROP,
        ) as loader:
            loader.set_epoch(2)
            for i, batch in enumerate(loader):
                got.append(digest(batch))
                if i == 1:
                    srv.kill()
                    srv = stack.enter_context(
                        run_server(
                            store, *args, http_port=http, data_port=data, workdir=tmp_path / "w"
                        )
                    )
            assert loader.stats().reconnects >= 1
    assert got == ref
