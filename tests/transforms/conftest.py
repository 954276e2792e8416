"""Stores and servers for the transform tests: a cifar-like store, and servers that load
the test transforms of :mod:`tests.transforms.mods` through ``--transforms``."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.data import make_cifar_like
from tests.support.slowness import scaled

N = 600
MODS = ("--transforms", "tests.transforms.mods")
#: CIFAR's recipe on the test data (CHW uint8): pad-4 crop, flip, normalize to float32.
CIFAR_CHAIN = [
    {"name": "random_crop", "params": {"size": 32, "padding": 4, "layout": "CHW"}},
    {"name": "hflip", "params": {"layout": "CHW"}},
    {
        "name": "normalize",
        "params": {"layout": "CHW", "scale": 1 / 255, "mean": [0.5] * 3, "std": [0.25] * 3},
    },
]
#: The same plus a pure-Python sample transform (runs in worker processes under "auto").
MIXED_CHAIN = [*CIFAR_CHAIN, {"name": "py_noise", "params": {"scale": 2.0}}]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tstore")
    make_cifar_like(root, n=N, shard_bytes=256 << 10)
    return root


def digest(batch: dict) -> str:
    """sha256 over every field's name, dtype, shape and bytes: equal iff byte-identical."""
    h = hashlib.sha256()
    for k in sorted(batch):
        t = batch[k]
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def pool_status(url: str) -> dict:
    r = httpx.get(f"{url}/v1/transforms", timeout=scaled(10))
    assert r.status_code == 200, r.text
    return r.json()


def shm_segments(pid: int) -> list[str]:
    """Shared-memory rings a server process made (named after its pid)."""
    from shardserve.server.runtime.rings import DEFAULT_DIR, PREFIX

    return (
        [p.name for p in Path(DEFAULT_DIR).glob(f"{PREFIX}{pid}-*")]
        if os.path.isdir(DEFAULT_DIR)
        else []
    )


@pytest.fixture
def no_leftovers() -> Iterator[list[int]]:
    """Append server and worker pids; after the test none runs and no ring of theirs is left."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        assert not alive(pid), f"process {pid} outlived its server"
        assert not shm_segments(pid), f"shared memory left by {pid}: {shm_segments(pid)}"
