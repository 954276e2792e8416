"""Small deterministic datasets for tests, written through the real ``ShardWriter``.

Both generators encode each sample's index in its contents so a test can check exactly which
samples arrived (exactly-once delivery, ordering, rank partitions):

* cifar-like: ``image`` ``uint8[3,32,32]``, ``label`` ``int64``. The first 4 bytes of the
  flattened image are the sample index as a little-endian ``uint32``; the remaining bytes are
  pseudo-random from ``(seed, index)``; ``label == index % 10``. :func:`sample_id_of` decodes
  a batch back to indices.
* graph-like: ``x`` ``float32[-1,8]`` (1-24 atoms), ``edge_index`` ``int64[2,-1]`` (0-40 edges,
  values < n_atoms), ``y`` ``float32`` scalar equal to the index, ``smiles`` binary
  ``b"C" * n_atoms + b"#<index>"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from bench._support import CIFAR_FIELDS, cifar_images, make_cifar_like
from shardserve.proto.manifest import FieldSpec, Manifest
from shardserve.server.store.write.writer import ShardWriter

__all__ = [
    "CIFAR_FIELDS",
    "EVERY_KIND_FIELDS",
    "GRAPH_FIELDS",
    "cifar_images",
    "every_kind_sample",
    "graph_sample",
    "make_cifar_like",
    "make_graph_like",
    "sample_id_of",
]

GRAPH_FIELDS = (
    FieldSpec(name="x", dtype="float32", shape=(-1, 8)),
    FieldSpec(name="edge_index", dtype="int64", shape=(2, -1)),
    FieldSpec(name="y", dtype="float32", shape=()),
    FieldSpec(name="smiles", dtype="binary", shape=()),
)


def graph_sample(i: int, seed: int = 0) -> dict[str, object]:
    """Sample ``i`` of the graph-like dataset (see module doc)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, i])))
    atoms = int(rng.integers(1, 25))
    edges = int(rng.integers(0, 41))
    return {
        "x": rng.standard_normal((atoms, 8)).astype(np.float32),
        "edge_index": rng.integers(0, atoms, size=(2, edges)).astype(np.int64),
        "y": np.float32(i),
        "smiles": b"C" * atoms + b"#" + str(i).encode(),
    }


def make_graph_like(
    root: str | Path, name: str = "graphs", n: int = 200, seed: int = 0, shard_bytes: int = 32 << 10
) -> Manifest:
    """Write a graph-like dataset of ``n`` variable-size samples (small shards: several of them)."""
    with ShardWriter(root, name, fields=GRAPH_FIELDS, shard_bytes=shard_bytes) as w:
        for i in range(n):
            w.add(graph_sample(i, seed))
    return w.manifest


def sample_id_of(batch_parts: Mapping[str, np.ndarray]) -> np.ndarray:
    """Sample indices (int64) of a cifar-like batch, decoded from the image's first 4 bytes.

    Accepts numpy arrays or anything ``np.asarray`` takes (e.g. CPU torch tensors). When a
    ``label`` part is present it must agree (``index % 10``), else ``AssertionError``.
    """
    image = np.asarray(batch_parts["image"])
    b = image.shape[0]
    head = np.ascontiguousarray(image.reshape(b, -1)[:, :4]).astype(np.uint8)
    ids = head.view("<u4").reshape(b).astype(np.int64)
    if "label" in batch_parts:
        labels = np.asarray(batch_parts["label"]).reshape(b)
        bad = np.flatnonzero(labels != ids % 10)
        assert bad.size == 0, f"label of sample {ids[bad[0]]} is {labels[bad[0]]}, not id % 10"
    return ids


#: One field of every kind: fixed, nullable scalar and tensor (with nulls), variable, binary,
#: bool and variable bool (about 1.7 KB a sample).
EVERY_KIND_FIELDS = (
    FieldSpec(name="img", dtype="uint8", shape=(16, 64)),
    FieldSpec(name="n", dtype="float32", shape=(), nullable=True),
    FieldSpec(name="t", dtype="float32", shape=(4,), nullable=True),
    FieldSpec(name="v", dtype="int16", shape=(-1,)),
    FieldSpec(name="b", dtype="binary", shape=()),
    FieldSpec(name="f", dtype="bool", shape=()),
    FieldSpec(name="vb", dtype="bool", shape=(-1,)),
)


def every_kind_sample(i: int) -> dict[str, object]:
    """Sample ``i`` of a dataset of :data:`EVERY_KIND_FIELDS` (``None``: a missing value)."""
    return {
        "img": np.full((16, 64), i % 251, np.uint8),
        "n": None if i % 3 == 0 else np.float32(i),
        "t": None if i % 5 == 0 else np.full(4, i, np.float32),
        "v": np.full(i % 200, i, np.int16),
        "b": bytes([i % 256]) * (i % 300),
        "f": bool(i % 2),
        "vb": np.arange(i % 7) % 3 == 0,
    }
