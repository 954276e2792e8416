"""Block checksums: a read verifies the blocks it reads, and no damaged byte is ever served."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from shardserve.proto.errors import DatasetCorruptError
from shardserve.proto.manifest import FieldSpec, ShardInfo
from shardserve.server.store.catalog import Store
from shardserve.server.store.layout import BLOCK_BYTES
from shardserve.server.store.write.writer import ShardWriter
from tests.support.data import EVERY_KIND_FIELDS, every_kind_sample

N = 3000


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind of field (fixed, nullable with and without nulls, variable, binary, bool)
    in two shards of several 1 MiB blocks."""
    root = tmp_path_factory.mktemp("blocks")
    with ShardWriter(root, "d", fields=EVERY_KIND_FIELDS, shard_bytes=3 << 20) as w:
        for i in range(N):
            w.add(every_kind_sample(i))
    assert w.manifest is not None and w.manifest.shards[0].num_blocks >= 3
    return root


def _read_all(root: Path) -> dict[str, np.ndarray]:
    """Every field of every sample, in batches of 100, from a newly opened store."""
    store = Store(root)
    try:
        ds = store.open("d")
        parts = [ds.take(np.arange(s, min(N, s + 100))) for s in range(0, N, 100)]
    finally:
        store.close()
    out: dict[str, np.ndarray] = {}
    for name in parts[0]:
        if name.endswith(".offsets"):
            continue
        out[name] = np.concatenate([p[name] for p in parts])
    return out


def _flipped(path: Path, at: int) -> bytes:
    data = path.read_bytes()
    damaged = bytearray(data)
    damaged[at] ^= 0xFF
    path.write_bytes(bytes(damaged))
    return data


def test_a_byte_damaged_anywhere_is_never_served(store: Path) -> None:
    """A flipped byte at 57 places across a shard (headers, row data of every kind of field,
    bitmaps, offsets, the footer): reading every field of every sample never returns a
    changed value, and fails with DatasetCorruptError naming the shard: a read of everything
    verifies every block."""
    clean = _read_all(store)
    for i in (0, 1, 2999):
        assert clean["img"][i, 0, 0] == i % 251
    shard = sorted((store / "d").rglob("*.arrow"))[0]
    size = shard.stat().st_size
    places = sorted(
        {
            *np.linspace(0, size - 1, 50).astype(int).tolist(),
            8,
            20,
            200,
            600,
            size - 1,
            size - 9,
            size - 40,
            size - 200,
        }
    )
    caught = 0
    for at in places:
        original = _flipped(shard, at)
        try:
            got = _read_all(store)
        except DatasetCorruptError as e:
            assert shard.name in str(e), e
            caught += 1
        else:
            for name, values in clean.items():
                assert np.array_equal(got[name], values), f"byte {at}: field {name} changed"
        finally:
            shard.write_bytes(original)
    assert caught == len(places), f"only {caught} of {len(places)} flips were caught"


def _row_byte(shard: Path, field: str, row: int) -> int:
    """The file offset of a byte inside ``row``'s value of ``field`` in ``shard`` (where
    pyarrow's views of the mapped file say the row lies)."""
    mm = pa.memory_map(str(shard))
    base = mm.read_buffer(mm.size()).address
    mm.seek(0)
    reader = pa.ipc.open_file(mm)
    for i in range(reader.num_record_batches):
        batch = reader.get_batch(i)
        if row >= batch.num_rows:
            row -= batch.num_rows
            continue
        col = batch.column(field)
        if field == "img":
            return int(col.flatten().buffers()[1].address - base) + row * 16 * 64 + 5
        offsets = np.frombuffer(col.buffers()[1], dtype=np.int32)
        data, itemsize = (col.buffers()[2], 1) if field == "b" else (col.buffers()[3], 2)
        return int(data.address - base) + int(offsets[row]) * itemsize + 1
    raise AssertionError(f"no row {row} in {shard}")


ROW_FIELDS = {
    "img": FieldSpec(name="img", dtype="uint8", shape=(16, 64)),
    "v": FieldSpec(name="v", dtype="int16", shape=(-1,)),
    "b": FieldSpec(name="b", dtype="binary", shape=()),
}


def _row(field: str, i: int) -> object:
    """Sample ``i``'s value of a one-field dataset (about 1 KiB a row)."""
    if field == "img":
        return np.full((16, 64), i % 251, np.uint8)
    if field == "v":
        return np.full(450 + i % 100, i, np.int16)
    return bytes([i % 256]) * (950 + i % 100)


@pytest.mark.parametrize("field", ["img", "v", "b"])
def test_a_damaged_row_fails_its_reads_and_other_blocks_still_serve(
    tmp_path: Path, field: str
) -> None:
    """A flipped byte in sample 1500's row (a fixed, variable or binary field, 3 MB in one
    shard): reading a sample blocks away returns it exactly; reading sample 1500 fails naming
    the shard and the block; the shard is refused from then on."""
    with ShardWriter(tmp_path, "one", fields=[ROW_FIELDS[field]], shard_bytes=8 << 20) as w:
        for i in range(N):
            w.add({field: _row(field, i)})
    assert w.manifest is not None and len(w.manifest.shards) == 1
    shard = tmp_path / "one" / w.manifest.shards[0].path
    at, far = _row_byte(shard, field, 1500), 200
    assert at // BLOCK_BYTES != _row_byte(shard, field, far) // BLOCK_BYTES
    _flipped(shard, at)
    st = Store(tmp_path)
    ds = st.open("one")
    got = ds.take([far])
    if field == "b":
        assert bytes(got["b"]) == _row(field, far)
    else:
        assert np.array_equal(got[field].reshape(np.shape(_row(field, far))), _row(field, far))
    block = rf"{shard.name} failed its checksum at block {at // BLOCK_BYTES} "
    with pytest.raises(DatasetCorruptError, match=block):
        ds.take([1500])
    with pytest.raises(DatasetCorruptError, match=shard.name):
        ds.take([far])
    st.close()


def test_a_store_written_before_block_checksums_checks_whole_shards(
    store: Path, tmp_path: Path
) -> None:
    """The same shards listed without block checksums: a flipped byte anywhere in a shard
    fails its first read, whichever sample it asks for (the whole file is hashed)."""
    old = tmp_path / "old"
    (old / "d" / "shards").mkdir(parents=True)
    doc = json.loads((store / "d" / "manifest.json").read_text())
    for s in doc["shards"]:
        del s["block_bytes"], s["blocks"]
        (old / "d" / s["path"]).write_bytes((store / "d" / s["path"]).read_bytes())
    (old / "d" / "manifest.json").write_text(json.dumps(doc))
    shard = old / "d" / doc["shards"][0]["path"]
    _flipped(shard, _row_byte(shard, "img", 100))
    st = Store(old)
    with pytest.raises(DatasetCorruptError, match=rf"{shard.name} failed its checksum: "):
        st.open("d").take([2200], ["img"])
    st.close()


def _entry(nbytes: int, **blocks: object) -> ShardInfo:
    return ShardInfo(path="s", rows=1, bytes=nbytes, checksum="x", **blocks)


def test_block_checksums_must_cover_the_file() -> None:
    """A manifest entry with blocks of the wrong count, one half of the pair, or blocks too
    small to bound what a reader allocates for them is refused."""
    size = 3 * BLOCK_BYTES + 1
    assert _entry(size, block_bytes=BLOCK_BYTES, blocks="0" * 64).num_blocks == 4
    with pytest.raises(ValueError, match="must be 64 hex digits"):
        _entry(size, block_bytes=BLOCK_BYTES, blocks="0" * 48)
    with pytest.raises(ValueError, match="come together"):
        _entry(10, block_bytes=BLOCK_BYTES)
    with pytest.raises(ValueError, match="greater than or equal to 4096"):
        _entry(10, block_bytes=16, blocks="0" * 16)
    assert "blocks" not in _entry(10).model_dump()
