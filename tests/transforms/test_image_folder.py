"""``shardserve ingest`` of a CLASS/IMAGE.jpg folder stores encoded bytes, labels and class
names; a Loader with decode + random resized crop gets fixed-size images and the labels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from shardserve.client import Loader
from tests.support.server import run_server
from tests.support.slowness import scaled
from tests.transforms.conftest import digest, pool_status

CLASSES = ["cat", "dog", "zebra"]


def _folder(root: Path) -> list[tuple[str, int]]:
    rng = np.random.default_rng(0)
    expected = []
    for label, c in enumerate(CLASSES):
        (root / c).mkdir(parents=True)
        for i in range(6):
            a = rng.integers(0, 255, (16 + 3 * i, 24 + i, 3), dtype=np.uint8)
            name = f"{i:02d}.{'png' if i % 2 else 'jpg'}"
            Image.fromarray(a).save(root / c / name)
            expected.append((f"{c}/{name}", label))
    return expected


def _ingest(src: Path, store: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "shardserve.server",
        "ingest",
        str(src),
        "--store",
        str(store),
        "--name",
        "pets",
        "--quiet",
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(120))


@pytest.mark.slow
def test_image_folder_ingest_and_decode_at_serving_time(tmp_path: Path) -> None:
    """Labels follow sorted class folders; class names are in the manifest and the dataset
    info; decode + random_resized_crop + normalize serve [B, 3, 16, 16] float32, the same on
    every run."""
    src, store = tmp_path / "src", tmp_path / "store"
    expected = _folder(src)
    r = _ingest(src, store)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((store / "pets" / "manifest.json").read_text())
    assert json.loads(manifest["source"]["classes"]) == CLASSES
    assert manifest["num_samples"] == len(expected)
    chain = [
        {"name": "decode_image"},
        {"name": "random_resized_crop", "params": {"size": 16}},
        {"name": "normalize", "params": {"scale": 1 / 255, "to_chw": True}},
    ]
    with run_server(store) as srv:
        info = httpx.get(f"{srv.http_url}/v1/datasets/pets", timeout=scaled(10)).json()
        assert info["classes"] == CLASSES
        assert {f["name"]: f["dtype"] for f in info["fields"]} == {
            "image": "binary",
            "label": "int64",
        }
        runs = []
        for _ in range(2):
            with Loader(
                srv.http_url,
                "pets",
                batch_size=4,
                shuffle=False,
                transforms=chain,
                timeout=scaled(30),
            ) as ld:
                ld.set_epoch(0)
                runs.append(list(ld))
        labels = [int(x) for b in runs[0] for x in b["label"]]
        assert labels == [lab for _, lab in expected]
        assert all(b["image"].shape[1:] == (3, 16, 16) for b in runs[0])
        assert [digest(b) for b in runs[0]] == [digest(b) for b in runs[1]]


def test_one_step_decode_and_crop_is_the_same_on_threads_and_worker_processes(
    tmp_path: Path, no_leftovers: list[int]
) -> None:
    """``decode_random_resized_crop`` serves [B, 16, 16, 3] uint8 crops of JPEGs and PNGs,
    byte for byte the same from a thread pool and from worker processes; the processes read
    the encoded bytes from their input files and write every crop into the stream's shared
    memory."""
    src, store = tmp_path / "src", tmp_path / "store"
    expected = _folder(src)
    assert _ingest(src, store).returncode == 0
    chain = [{"name": "decode_random_resized_crop", "params": {"size": 16}}]

    def epoch(url: str) -> tuple[list[str], int]:
        with Loader(
            url,
            "pets",
            batch_size=4,
            shuffle=False,
            transforms=chain,
            timeout=scaled(30),
            fields=["image"],
        ) as ld:
            ld.set_epoch(0)
            batches = list(ld)
        assert all(b["image"].shape[1:] == (16, 16, 3) for b in batches)
        return [digest(b) for b in batches], sum(b["image"].nbytes for b in batches)

    with run_server(store, "--transform-pool", "thread") as srv:
        want, served = epoch(srv.http_url)
    assert served == len(expected) * 16 * 16 * 3
    with run_server(store, "--transform-pool", "process") as srv:
        no_leftovers.append(srv.proc.pid)
        assert epoch(srv.http_url)[0] == want
        status = pool_status(srv.http_url)
        no_leftovers.extend(status["pool"]["pids"])
        counts = status["counts"]
        assert counts["worker_bytes_in_place"] == served, counts
        assert counts["worker_input_bytes_via_shm"] > 0, counts


def test_image_folder_with_loose_images_is_refused(tmp_path: Path) -> None:
    """An image outside a class folder: a clear error, nothing published."""
    src, store = tmp_path / "src", tmp_path / "store"
    _folder(src)
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(src / "stray.png")
    r = _ingest(src, store, "--format", "imagefolder")
    assert r.returncode != 0 and "outside class folders" in r.stderr
    assert not (store / "pets" / "manifest.json").exists()
