"""The read path stays lean: a server streaming every kind of field never loads pandas."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardserve.client import Loader
from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.writer import ShardWriter
from tests.support.server import run_server

FIELDS = [
    FieldSpec(name="img", dtype="uint8", shape=(4, 4)),
    FieldSpec(name="n", dtype="float32", shape=(), nullable=True),
    FieldSpec(name="t", dtype="float32", shape=(4,), nullable=True),
    FieldSpec(name="v", dtype="int16", shape=(-1,)),
    FieldSpec(name="b", dtype="binary", shape=()),
    FieldSpec(name="f", dtype="bool", shape=()),
    FieldSpec(name="vb", dtype="bool", shape=(-1,)),
]


def _sample(i: int) -> dict[str, object]:
    return {
        "img": np.full((4, 4), i % 251, np.uint8),
        "n": None if i % 3 == 0 else np.float32(i),
        "t": None if i % 5 == 0 else np.full(4, i, np.float32),
        "v": np.full(i % 20, i, np.int16),
        "b": bytes([i % 256]) * (i % 30),
        "f": bool(i % 2),
        "vb": np.arange(i % 7) % 3 == 0,
    }


def _maps_pandas(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("/pandas/" in line for line in f)


def test_streaming_every_kind_of_field_never_loads_pandas(tmp_path: Path) -> None:
    """pyarrow's own numpy conversions import pandas where it is installed (0.15-0.3 s and
    ~28 MiB of private memory in the server); the read path views Arrow buffers itself. A
    server streaming fixed, nullable, variable, binary and bool fields across many chunks
    returns every value exactly and has no pandas library mapped."""
    pytest.importorskip("pandas")  # only meaningful where pyarrow could import it
    n = 2000
    with ShardWriter(tmp_path, "d", fields=FIELDS, shard_bytes=64 << 10) as w:
        for i in range(n):
            w.add(_sample(i))
    assert w.manifest is not None and len(w.manifest.shards) > 3
    with run_server(tmp_path) as srv, Loader(srv.http_url, "d", 64, shuffle=False) as ld:
        seen = 0
        for batch in ld:
            for j in range(len(batch["img"])):
                _check(batch, j, seen + j)
            seen += len(batch["img"])
        assert not _maps_pandas(srv.proc.pid), "the server loaded pandas while streaming"
    assert seen == n


def _check(batch: dict, j: int, i: int) -> None:
    """Row ``j`` of ``batch`` is exactly sample ``i``."""
    want = _sample(i)
    assert (batch["img"][j].numpy() == want["img"]).all()
    for name in ("n", "t"):
        masked = batch[name]
        assert bool(masked.mask[j]) == (want[name] is not None), (name, i)
        if want[name] is not None:
            assert np.array_equal(masked.values[j].numpy(), want[name]), (name, i)
    for name in ("v", "b", "vb"):
        var = batch[name]
        lo, hi = int(var.offsets[j]), int(var.offsets[j + 1])
        got = var.values[lo:hi].numpy()
        expect = np.frombuffer(want[name], np.uint8) if name == "b" else want[name]
        assert np.array_equal(got, expect), (name, i)
    assert bool(batch["f"][j]) == want["f"]
