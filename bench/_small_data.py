"""The datasets of ``bench_small.py``, written with the store's own writer (and borrowed by
the benchmarks that need a CIFAR-like store): each generator is seeded, so every run and every
script writes the same samples.

::

    arrays = make_cifar(root, 50_000)      # also the arrays, for the in-RAM baselines
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.write.writer import ShardWriter

CIFAR = (
    FieldSpec(name="image", dtype="uint8", shape=(3, 32, 32)),
    FieldSpec(name="label", dtype="int64", shape=()),
)
GRAPH = (
    FieldSpec(name="x", dtype="float32", shape=(-1, 16)),
    FieldSpec(name="pos", dtype="float32", shape=(-1, 3)),
    FieldSpec(name="edge_index", dtype="int64", shape=(2, -1)),
    FieldSpec(name="y", dtype="float32", shape=()),
)
CRYSTAL = (
    FieldSpec(name="atom_fea", dtype="float32", shape=(-1, 16)),
    FieldSpec(name="edge_index", dtype="int64", shape=(2, -1)),
    FieldSpec(name="bond_fea", dtype="float32", shape=(-1, 8)),
    FieldSpec(name="energy", dtype="float32", shape=()),
)
SHOGI_PLANES = (104, 9, 9)
SHOGI_BYTES = -(-104 * 81 // 8)
SHOGI = (
    FieldSpec(name="packed", dtype="uint8", shape=(SHOGI_BYTES,)),
    FieldSpec(name="move", dtype="int64", shape=()),
    FieldSpec(name="result", dtype="float32", shape=()),
)


def make_cifar(root: Path, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {
        "image": rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8),
        "label": np.arange(n) % 10,
    }
    with ShardWriter(root, "cifar", fields=CIFAR, shard_bytes=64 << 20) as w:
        w.add_batch(arrays)
    return arrays


def graphs(n: int) -> Iterator[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    for i in range(n):
        a = int(rng.integers(2, 201))
        yield {
            "x": rng.standard_normal((a, 16), dtype=np.float32),
            "pos": rng.standard_normal((a, 3), dtype=np.float32),
            "edge_index": rng.integers(0, a, (2, 2 * a)).astype(np.int64),
            "y": np.float32(i),
        }


def make_graphs(root: Path, n: int, shards: int) -> str:
    name = f"graphs{shards}"
    approx = n * 101 * (16 * 4 + 3 * 4 + 2 * 2 * 8)  # mean atoms x bytes per atom
    with ShardWriter(root, name, fields=GRAPH, shard_bytes=approx // shards + 1) as w:
        for g in graphs(n):
            w.add(g)
    got = len(w.manifest.shards) if w.manifest else 0
    print(f"  {name}: {got} shards")
    return name


def crystals(n: int) -> Iterator[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    for i in range(n):
        a = int(rng.integers(2, 201))
        e = 4 * a
        yield {
            "atom_fea": rng.standard_normal((a, 16), dtype=np.float32),
            "edge_index": rng.integers(0, a, (2, e)).astype(np.int64),
            "bond_fea": rng.standard_normal((e, 8), dtype=np.float32),
            "energy": np.float32(i),
        }


def upt(n: int) -> Iterator[dict[str, Any]]:
    rng = np.random.default_rng(2)
    for i in range(n):
        yield {
            "points": rng.standard_normal((int(rng.integers(1000, 5001)), 3), dtype=np.float32),
            "params": None if i % 3 == 0 else rng.standard_normal(4, dtype=np.float32),
            "bc": None if i % 5 == 0 else np.arange(i % 7, dtype=np.int32),
        }


def make_upt(root: Path, n: int) -> str:
    with ShardWriter(root, "upt", shard_bytes=64 << 20, variable=["bc"]) as w:
        for s in upt(n):
            w.add(s)
    return "upt"


def make_shogi(root: Path, n: int) -> dict[str, np.ndarray]:
    """Shogi-like positions as the seed keeps them: 104 planes of 9x9 bits packed into 1,053
    bytes a position, a move label and a game result."""
    rng = np.random.default_rng(3)
    arrays = {
        "packed": rng.integers(0, 256, (n, SHOGI_BYTES), dtype=np.uint8),
        "move": rng.integers(0, 2187, n, dtype=np.int64),
        "result": rng.random(n, dtype=np.float32),
    }
    with ShardWriter(root, "shogi", fields=SHOGI, shard_bytes=64 << 20) as w:
        w.add_batch(arrays)
    return arrays


def make_crystals(root: Path, files: Path, n: int) -> str:
    """The crystals in the store (3 shards) and as one ``.pt`` dict per graph in ``files``."""
    files.mkdir(parents=True)
    approx = n * 101 * (16 * 4 + 4 * (2 * 8 + 8 * 4))
    with ShardWriter(root, "crystals", fields=CRYSTAL, shard_bytes=approx // 3 + 1) as w:
        for i, g in enumerate(crystals(n)):
            w.add(g)
            torch.save(
                {k: torch.from_numpy(np.asarray(v)) for k, v in g.items()}, files / f"{i:06d}.pt"
            )
    return "crystals"
