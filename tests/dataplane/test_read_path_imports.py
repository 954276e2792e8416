"""The read path stays lean: a server streaming every kind of field never loads pandas."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardserve.client import Loader
from shardserve.server.store.write.writer import ShardWriter
from tests.support.data import EVERY_KIND_FIELDS, every_kind_sample
from tests.support.server import run_server


def _maps_pandas(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("/pandas/" in line for line in f)


def test_streaming_every_kind_of_field_never_loads_pandas(tmp_path: Path) -> None:
    """A server streaming fixed, nullable, variable, binary and bool fields across many chunks
    returns every value exactly and has no pandas library mapped."""
    # pyarrow's own numpy conversions import pandas where it is installed (0.15-0.3 s and ~28 MiB of
    # private memory in the server); the read path views Arrow buffers itself.
    pytest.importorskip("pandas")  # only meaningful where pyarrow could import it
    n = 2000
    with ShardWriter(tmp_path, "d", fields=EVERY_KIND_FIELDS, shard_bytes=64 << 10) as w:
        for i in range(n):
            w.add(every_kind_sample(i))
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
    want = every_kind_sample(i)
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
