"""Fixed fields read across shards through one stitched mapping: where the pieces go (any row
size, any offsets), that batches read through it equal the stored samples, that a mixture
stitches across its sources, and that closing a dataset unmaps it."""

from __future__ import annotations

import gc
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.catalog import Store
from shardserve.server.store.read.dataset import Dataset
from shardserve.server.store.read.mixed import mixed_dataset
from shardserve.server.store.read.stitch import layout
from shardserve.server.store.write.writer import ShardWriter
from tests.support.data import EVERY_KIND_FIELDS, every_kind_sample

PAGE = 4096

#: Row sizes that stress the page arithmetic: odd, a page, past a page, and small.
FIELDS = (
    FieldSpec(name="odd", dtype="uint8", shape=(1053,)),
    FieldSpec(name="page", dtype="float32", shape=(1024,)),
    FieldSpec(name="wide", dtype="float32", shape=(3, 1500)),
    FieldSpec(name="small", dtype="float64", shape=(3, 5)),
    FieldSpec(name="id", dtype="int64", shape=()),
)
N = 240


def _rows(start: int, stop: int) -> dict[str, np.ndarray]:
    """Samples ``start..stop``: every value derived from its id, so any mix-up shows."""
    i = np.arange(start, stop)
    return {
        "odd": ((i[:, None] * 7 + np.arange(1053)) % 251).astype(np.uint8),
        "page": (i[:, None] + np.arange(1024) / 1024).astype(np.float32),
        "wide": (i[:, None, None] * 10.0 + np.arange(4500).reshape(3, 1500)).astype(np.float32),
        "small": (i[:, None, None] + np.arange(15).reshape(3, 5) / 16).astype(np.float64),
        "id": i.astype(np.int64),
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("stitch")
    for name, n, shard_bytes in (("rows", N, 256 << 10), ("more", 90, 128 << 10)):
        with ShardWriter(root, name, fields=FIELDS, shard_bytes=shard_bytes) as w:
            for lo in range(0, n, 40):
                w.add_batch(_rows(lo, min(n, lo + 40)))
    with ShardWriter(root, "kinds", fields=EVERY_KIND_FIELDS, shard_bytes=16 << 10) as w:
        for i in range(120):
            w.add(every_kind_sample(i))
    return Store(root)


@settings(max_examples=300, deadline=None)
@given(
    row_bytes=st.one_of(st.integers(1, 70_000), st.sampled_from([1024, 3072, 4096, 8192, 64])),
    pieces=st.lists(
        st.tuples(st.integers(0, 1 << 30), st.integers(0, 300)), min_size=1, max_size=8
    ),
    congruent=st.booleans(),
)
def test_layout_puts_every_piece_on_one_row_stride(
    row_bytes: int, pieces: list[tuple[int, int]], congruent: bool
) -> None:
    """Row 0 of each piece lands on one stride from virtual row 0 where its file offset says, in
    page-aligned, non-overlapping mappings that hold their rows, and offsets that disagree modulo
    gcd(row, page) have no layout."""
    g = math.gcd(row_bytes, PAGE)
    offsets = [o - (o - pieces[0][0]) % g if congruent else o for o, _ in pieces]
    rows = [n for _, n in pieces]
    lay = layout(offsets, rows, row_bytes, PAGE)
    used = [o for o, n in zip(offsets, rows, strict=True) if n]
    if not used or any((o - used[0]) % g for o in used):
        assert lay is None
        return
    assert lay is not None
    end = 0
    for off, n, first, (at, file_offset, length) in zip(
        offsets, rows, lay.first.tolist(), lay.maps, strict=True
    ):
        if not n:
            assert length == 0
            continue
        assert at % PAGE == 0 and file_offset % PAGE == 0 and length % PAGE == 0
        assert at >= end, "mappings overlap"
        row0 = lay.skew + first * row_bytes
        assert row0 - at == off - file_offset  # row 0 where the file has it
        assert row0 + n * row_bytes <= at + length  # every row inside its mapping
        assert first + n <= lay.rows
        end = at + length
    assert lay.size == end


def _check(ds: Dataset, idx: np.ndarray, out: bool) -> None:
    want = _rows(0, N)
    bufs = {f.name: np.empty((idx.size, *f.shape), f.dtype) for f in FIELDS} if out else None
    parts = ds.take(idx, out=bufs)
    for f in FIELDS:
        np.testing.assert_array_equal(parts[f.name], want[f.name][idx], err_msg=f.name)
        if bufs is not None:
            assert parts[f.name] is bufs[f.name]


def test_every_fixed_field_is_stitched_across_shards(store: Store) -> None:
    """Shards of equal rows (240 = 20 x 12) keep every field at one offset in every file."""
    ds = store.open("rows")
    assert len(ds.manifest.shards) >= 4
    chunks = ds.shards.acquire(range(len(ds.manifest.shards)))
    try:
        assert chunks.stitched is not None
        for f in FIELDS:
            view = chunks.fixed[f.name][0]
            got = chunks.stitched.get(f.name, view.dtype, view.shape[1:])
            assert got is not None, f.name
            assert got.array.shape[1:] == f.shape and not got.array.flags.writeable
    finally:
        ds.shards.release(range(len(ds.manifest.shards)))


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, N - 1), min_size=2, max_size=100), out=st.booleans())
def test_batches_across_shards_equal_the_stored_rows(
    store: Store, ids: list[int], out: bool
) -> None:
    """Any ids, repeats and every shard included, into fresh arrays or the caller's."""
    _check(store.open("rows"), np.array(ids, dtype=np.int64), out)


def test_a_whole_permutation_equals_the_stored_rows(store: Store) -> None:
    _check(store.open("rows"), np.random.default_rng(3).permutation(N), out=True)


def test_a_mixture_is_stitched_across_its_sources(store: Store) -> None:
    a, b = store.open("rows"), store.open("more")
    mixed = mixed_dataset("mix:rows+more", [a, b], ["odd", "id"])
    ids = np.random.default_rng(5).permutation(N + 90)[:150]
    before = _mapped(store.root)
    parts = mixed.take(ids)
    # One more mapping of every shard of both sources: the mixture's own stitched "odd".
    assert _mapped(store.root) >= before + len(a.manifest.shards) + len(b.manifest.shards)
    want = np.concatenate([_rows(0, N)["odd"], _rows(0, 90)["odd"]])
    np.testing.assert_array_equal(parts["odd"], want[ids])
    assert parts["source"].tolist() == (ids >= N).astype(int).tolist()


def test_columns_copied_at_open_are_read_piece_by_piece(store: Store) -> None:
    """A scalar with missing values (copied at open, zeros where missing) has no piece in the files
    while a nullable tensor's values do, and both read as stored."""
    ds = store.open("kinds")
    chunks = ds.shards.acquire(range(len(ds.manifest.shards)))
    try:
        assert chunks.stitched is not None
        assert chunks.stitched.get("n", np.dtype("float32"), ()) is None
        assert chunks.stitched.get("img", np.dtype("uint8"), (16, 64)) is not None
        assert chunks.stitched.get("vb", np.dtype("bool"), ()) is None  # bit-packed
    finally:
        ds.shards.release(range(len(ds.manifest.shards)))
    ids = np.random.default_rng(1).permutation(120)[:70]
    parts = ds.take(ids)
    for j, i in enumerate(ids.tolist()):
        s = every_kind_sample(i)
        np.testing.assert_array_equal(parts["img"][j], s["img"])
        assert parts["n.mask"][j] == (s["n"] is not None)
        assert parts["t.mask"][j] == (s["t"] is not None)
        if s["t"] is not None:
            np.testing.assert_array_equal(parts["t"][j], s["t"])
        for name in ("v", "b", "vb"):  # variable int16, bytes, bit-packed bools
            lo, hi = parts[f"{name}.offsets"][j : j + 2]
            want = s[name]
            got = parts[name][lo:hi]
            if name == "b":
                assert got.tobytes() == want
            else:
                np.testing.assert_array_equal(got, want)


#: Variable fields, their values stitched item by item and moved in units of their fixed
#: dims: rows of 8 float32, pairs of int64 (``[2, E]``), bytes, and 4 KiB rows.
RAGGED = (
    FieldSpec(name="x", dtype="float32", shape=(-1, 8)),
    FieldSpec(name="edge_index", dtype="int64", shape=(2, -1)),
    FieldSpec(name="smiles", dtype="binary", shape=()),
    FieldSpec(name="wide", dtype="float32", shape=(-1, 1024)),
)
RAGGED_DTYPES = {"x": "float32", "edge_index": "int64", "smiles": "uint8", "wide": "float32"}
N_RAGGED = 150


def _ragged_sample(i: int) -> dict[str, object]:
    atoms, edges, rows = 1 + i % 30, (i * 7) % 41, i % 3
    return {
        "x": np.arange(atoms * 8, dtype=np.float32).reshape(atoms, 8) + i,
        "edge_index": np.arange(2 * edges, dtype=np.int64).reshape(2, edges) * 1000 + i,
        "smiles": b"C" * atoms + str(i).encode(),
        "wide": np.full((rows, 1024), i, np.float32),
    }


@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    root = tmp_path_factory.mktemp("stitch-ragged")
    with ShardWriter(root, "g", fields=RAGGED, shard_bytes=24 << 10) as w:
        for i in range(N_RAGGED):
            w.add(_ragged_sample(i))
    ds = Store(root).open("g")
    assert len(ds.manifest.shards) >= 8
    return ds


def test_variable_fields_are_stitched_in_units(ragged: Dataset) -> None:
    shards = range(len(ragged.manifest.shards))
    chunks = ragged.shards.acquire(shards)
    try:
        assert chunks.stitched is not None
        for name, dtype in RAGGED_DTYPES.items():
            got = chunks.stitched.get(name, np.dtype(dtype), ())
            assert got is not None and got.array.ndim == 1, name
    finally:
        ragged.shards.release(shards)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, N_RAGGED - 1), min_size=2, max_size=70))
def test_variable_fields_across_shards_equal_the_stored_samples(
    ragged: Dataset, ids: list[int]
) -> None:
    """Long samples (one slice each) and short ones (an index per unit) alike."""
    parts = ragged.take(np.array(ids, dtype=np.int64))
    for name in ("x", "edge_index", "smiles", "wide"):
        off = parts[f"{name}.offsets"]
        assert off[0] == 0 and off.size == len(ids) + 1
        for j, i in enumerate(ids):
            want = _ragged_sample(i)[name]
            got = parts[name][off[j] : off[j + 1]]
            if name == "smiles":
                assert got.tobytes() == want
            else:
                shape = parts[f"{name}.shapes"][j]
                np.testing.assert_array_equal(got.reshape(shape), want)


def _mapped(folder: Path) -> int:
    """Mappings of files under ``folder`` in this process."""
    with open("/proc/self/maps") as f:
        return sum(str(folder) in line for line in f)


def test_closing_a_dataset_unmaps_what_it_stitched(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, "t", fields=FIELDS, shard_bytes=256 << 10) as w:
        w.add_batch(_rows(0, 120))
    store = Store(tmp_path)
    ds = store.open("t")
    shards = len(ds.manifest.shards)
    plain = _mapped(tmp_path)
    _check(ds, np.arange(120)[::-1].copy(), out=False)
    stitched = _mapped(tmp_path)
    assert stitched >= plain + shards * 4  # four fields with rows past 64 bytes, per shard
    store.close()
    del ds
    gc.collect()
    assert _mapped(tmp_path) == 0


#: A variable field first: the fixed fields behind it sit at offsets that move with its sizes.
BEHIND = (
    FieldSpec(name="v", dtype="int16", shape=(-1,)),
    FieldSpec(name="img", dtype="uint8", shape=(3, 32, 32)),
    FieldSpec(name="odd", dtype="uint8", shape=(1053,)),
)


def _behind(i: int) -> dict[str, np.ndarray]:
    return {
        "v": np.full((i * 13) % 97, i, np.int16),
        "img": np.full((3, 32, 32), i % 251, np.uint8),
        "odd": ((np.arange(1053) + i) % 253).astype(np.uint8),
    }


def test_fields_that_cannot_be_stitched_are_read_beside_those_that_are(tmp_path: Path) -> None:
    """3 KiB rows whose offsets disagree modulo 1 KiB are left to the per-shard copies; the
    1,053-byte rows and the variable values are stitched; one batch reads all three."""
    with ShardWriter(tmp_path, "b", fields=BEHIND, shard_bytes=64 << 10) as w:
        for i in range(200):
            w.add(_behind(i))
    ds = Store(tmp_path).open("b")
    shards = range(len(ds.manifest.shards))
    chunks = ds.shards.acquire(shards)
    try:
        assert chunks.stitched is not None
        assert chunks.stitched.get("img", np.dtype("uint8"), (3, 32, 32)) is None
        assert chunks.stitched.get("odd", np.dtype("uint8"), (1053,)) is not None
        assert chunks.stitched.get("v", np.dtype("int16"), ()) is not None
    finally:
        ds.shards.release(shards)
    ids = np.random.default_rng(2).permutation(200)[:90]
    parts = ds.take(ids)
    off = parts["v.offsets"]
    for j, i in enumerate(ids.tolist()):
        want = _behind(i)
        np.testing.assert_array_equal(parts["img"][j], want["img"])
        np.testing.assert_array_equal(parts["odd"][j], want["odd"])
        np.testing.assert_array_equal(parts["v"][off[j] : off[j + 1]], want["v"])
    ds.close()
