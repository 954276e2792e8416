"""MosaicML MDS folders, written by Streaming's own ``MDSWriter`` (in ``.venv-mds``, see
``mds_writer.py``), ingested and read back through a real server and Loader: every value
equal to what Streaming's ``StreamingDataset`` yields, with images kept encoded."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import xxhash

from shardserve.proto.errors import InvalidDataError
from shardserve.server.store.ingest.inflate import CHUNK
from shardserve.server.store.ingest.run import ingest, ingest_all
from tests.formats.support import assert_same, read_all
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]
#: Streaming pins numpy<2.2 and transformers<5 (whose huggingface_hub<1 the dev extra's
#: datasets refuses), so it lives in an environment of its own; .ci/run makes it.
MDS_PYTHON = Path(os.environ.get("SHARDSERVE_MDS_PYTHON", ROOT / ".venv-mds" / "bin" / "python"))
WRITTEN = {"zstd": 40, "plain": 25, "gz": 12, "snappy": 9}

pytestmark = pytest.mark.skipif(
    not MDS_PYTHON.exists(),
    reason=f"no MosaicML Streaming environment at {MDS_PYTHON} (.ci/run makes .venv-mds)",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    src = tmp_path_factory.mktemp("mds")
    subprocess.run(
        [str(MDS_PYTHON), str(ROOT / "tests" / "formats" / "mds_writer.py"), str(src)],
        check=True,
        timeout=scaled(600),
    )
    store = tmp_path_factory.mktemp("store")
    for name in WRITTEN:
        ingest(src / name, store, name, progress=False)
    with np.load(src / "want.npz", allow_pickle=False) as npz:
        want = dict(npz)
    return {
        "src": src,
        "store": store,
        "want": want,
        "kinds": json.loads((src / "kinds.json").read_text()),
    }


@pytest.fixture(scope="module")
def server(built: dict[str, Any]) -> Iterator[ServerProc]:
    with run_server(built["store"]) as srv:
        yield srv


def _json_as_loaded(value: Any) -> Any:
    """A JSON value as ingest stores it and the Loader gives it back."""
    if isinstance(value, dict):
        return {k: _json_as_loaded(v) for k, v in value.items()}
    if isinstance(value, list):
        return np.array(
            value, dtype=np.float64 if any(isinstance(v, float) for v in value) else np.int64
        )
    if isinstance(value, int):
        return np.array(value, dtype=np.int64)
    if isinstance(value, float):
        return np.array(value, dtype=np.float64)
    return value


def _expected(built: dict[str, Any], name: str, i: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for col, kind in built["kinds"].items():
        rec = built["want"][f"{name}/{i}/{col}"]
        if kind == "str":
            out[col] = str(rec)
        elif kind == "bytes":
            out[col] = rec.tobytes()
        elif kind == "json":
            out[col] = _json_as_loaded(json.loads(str(rec)))
        else:
            out[col] = rec
    return out


@pytest.mark.parametrize("name", list(WRITTEN))
def test_values_equal_what_streaming_dataset_yields(
    built: dict[str, Any], server: ServerProc, name: str
) -> None:
    PIL = pytest.importorskip("PIL.Image")
    got = read_all(server.http_url, name, batch_size=6)
    assert len(got) == WRITTEN[name]
    for i, sample in enumerate(got):
        want = _expected(built, name, i)
        image = want.pop("png")  # Streaming decodes it; ingest keeps the PNG bytes
        png = sample.pop("png").numpy().tobytes()
        assert png.startswith(b"\x89PNG"), f"{name}[{i}].png"
        assert np.array_equal(np.asarray(PIL.open(io.BytesIO(png))), image), f"{name}[{i}].png"
        assert_same(sample, want, f"{name}[{i}]")


def test_a_pickled_column_is_refused_naming_it(built: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(InvalidDataError, match=r"column 'obj' is pickled and is never unpickled"):
        ingest(built["src"] / "pickled", tmp_path, "p", progress=False)
    assert not (tmp_path / "p").exists()


def test_split_folders_become_a_dataset_each(built: dict[str, Any], tmp_path: Path) -> None:
    report = ingest_all(built["src"] / "splits", tmp_path, "s", progress=False)
    assert {d.manifest.name: d.manifest.num_samples for d in report.summaries} == {
        "s-train": 6,
        "s-val": 3,
    }


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_shard_is_refused_naming_it(
    built: dict[str, Any], tmp_path: Path, damage: str
) -> None:
    """The "plain" dataset lists sha1 hashes: a flipped byte fails its hash; a truncated
    shard is refused by its size before any sample is read."""
    src = tmp_path / "src"
    shutil.copytree(built["src"] / "plain", src)
    shard = src / "shard.00001.mds"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[-10:]
    shard.write_bytes(bytes(data))
    msg = "sha1 hash is not the one index.json lists" if damage == "flip" else "truncated"
    with pytest.raises(InvalidDataError, match=rf"shard\.00001\.mds.*{msg}"):
        ingest(src, tmp_path / "store", "d", progress=False)
    assert not (tmp_path / "store" / "d").exists()


def test_the_command_line_reads_it(built: dict[str, Any], tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardserve.server",
            "ingest",
            str(built["src"] / "gz"),
            "--store",
            str(tmp_path),
            "--name",
            "cli",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "ingested cli: 12 samples" in out.stdout + out.stderr


def test_a_shard_path_out_of_the_folder_is_refused(built: dict[str, Any], tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(built["src"] / "gz", src)
    index = json.loads((src / "index.json").read_text())
    index["shards"][0]["zip_data"]["basename"] = "../../etc/passwd"
    (src / "index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidDataError, match=r"'\.\./\.\./etc/passwd' is not a file name"):
        ingest(src, tmp_path / "store", "t", progress=False)


def _copy_with_index(built: dict[str, Any], tmp_path: Path, name: str) -> tuple[Path, dict]:
    src = tmp_path / "src"
    shutil.copytree(built["src"] / name, src)
    return src, json.loads((src / "index.json").read_text())


def test_a_negative_column_size_is_one_line_naming_the_field(
    built: dict[str, Any], tmp_path: Path
) -> None:
    """``column_sizes: [-4, null, ...]`` ends the ingest command with one line naming the
    index, the shard entry and the column, not a traceback."""
    src, index = _copy_with_index(built, tmp_path, "plain")
    sizes = index["shards"][0]["column_sizes"]
    index["shards"][0]["column_sizes"] = [-4, None, *sizes[2:]]
    (src / "index.json").write_text(json.dumps(index))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardserve.server",
            "ingest",
            str(src),
            "--store",
            str(tmp_path / "store"),
            "--name",
            "neg",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        cwd=ROOT,
    )
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    assert "index.json shard 0 column 'b': its column_sizes entry is -4" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) <= 2, out.stderr
    assert not (tmp_path / "store" / "neg").exists()


def test_a_shard_listed_twice_is_refused_naming_it(built: dict[str, Any], tmp_path: Path) -> None:
    """An index listing one shard three times would ingest its samples three times."""
    src, index = _copy_with_index(built, tmp_path, "zstd")
    first = index["shards"][0]
    index["shards"] = [first, *index["shards"], first]
    (src / "index.json").write_text(json.dumps(index))
    name = first["zip_data"]["basename"]
    with pytest.raises(
        InvalidDataError,
        match=rf"index\.json lists the shard {re.escape(name)} "
        r"twice \(shards 0 and 1\)",
    ):
        ingest(src, tmp_path / "store", "dup", progress=False)
    assert not (tmp_path / "store" / "dup").exists()


@pytest.mark.parametrize("name", ["plain", "zstd"])
def test_a_shard_linked_out_of_its_folder_is_refused(
    built: dict[str, Any], tmp_path: Path, name: str
) -> None:
    """A shard file that is a link to a file elsewhere (here: a valid copy of itself) is
    refused, as a LitData chunk is; a link that stays in the folder is read."""
    src, index = _copy_with_index(built, tmp_path, name)
    entry = index["shards"][1]
    shard = (entry["zip_data"] or entry["raw_data"])["basename"]
    outside = tmp_path / "elsewhere.mds"
    (src / shard).rename(outside)
    (src / shard).symlink_to(outside)
    with pytest.raises(
        InvalidDataError,
        match=rf"lists {re.escape(shard)}, a link to .*"
        r"elsewhere\.mds outside the folder",
    ):
        ingest(src, tmp_path / "store", "link", progress=False)
    assert not (tmp_path / "store" / "link").exists()
    (src / shard).unlink()
    outside.rename(src / "kept.bin")
    (src / shard).symlink_to(src / "kept.bin")
    s = ingest(src, tmp_path / "store", "link", progress=False)
    assert s.manifest.num_samples == WRITTEN[name]


#: What the hostile shards below declare (or inflate to): 1.5 GiB, from about 50 kB of zstd.
HUGE = 1536 << 20


def _zstd(path: Path, prefix: bytes, zeros: int) -> None:
    """``prefix`` then ``zeros`` zero bytes, as one zstd stream, written a block at a time."""
    block = bytes(16 << 20)
    with pa.CompressedOutputStream(str(path), "zstd") as f:
        f.write(prefix)
        for at in range(0, zeros, len(block)):
            f.write(block[: min(len(block), zeros - at)])


def _rehash(info: dict[str, Any], path: Path) -> None:
    """The listed hashes of ``info`` made those of ``path`` (a hostile writer lists true ones)."""
    data = path.read_bytes()
    info["bytes"] = len(data)
    info["hashes"] = {
        algo: hashlib.new(algo, data).hexdigest()
        if algo != "xxh64"
        else xxhash.xxh64_hexdigest(data)
        for algo in info.get("hashes") or {}
    }


def test_a_zstd_shard_declaring_a_huge_size_is_refused_at_its_header(
    built: dict[str, Any], tmp_path: Path
) -> None:
    """A ~50 kB zstd shard of zeros that declares 1.5 GiB for 8 samples (within 8 x
    --max-sample-bytes) is inflated as a stream: refused after its first 4 bytes, which
    say 0 samples, not after 1.5 GiB were inflated."""
    src, index = _copy_with_index(built, tmp_path, "zstd")
    entry = index["shards"][0]
    bomb = src / entry["zip_data"]["basename"]
    _zstd(bomb, b"", HUGE)
    assert bomb.stat().st_size < 100_000
    entry["samples"], entry["raw_data"]["bytes"] = 8, HUGE
    _rehash(entry["zip_data"], bomb)
    (src / "index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidDataError) as got:
        ingest(src, tmp_path / "store", "bomb", progress=False)
    read = re.search(
        rf"{re.escape(bomb.name)}: does not begin with its 8 samples' offsets \(refused after "
        rf"reading (\d+) of the {HUGE} bytes index\.json lists\)",
        str(got.value),
    )
    assert read is not None, got.value
    assert int(read.group(1)) <= 4
    assert not (tmp_path / "store" / "bomb").exists()


def test_a_zstd_shard_inflating_past_its_size_is_refused_within_a_chunk(
    built: dict[str, Any], tmp_path: Path
) -> None:
    """A shard whose samples are as listed but whose zstd stream then goes on for 1.5 GiB
    is refused once it passes the listed size, having read at most one chunk more."""
    src, index = _copy_with_index(built, tmp_path, "zstd")
    entry = index["shards"][0]
    shard = src / entry["zip_data"]["basename"]
    listed = int(entry["raw_data"]["bytes"])
    raw = pa.decompress(shard.read_bytes(), decompressed_size=listed, codec="zstd").to_pybytes()
    _zstd(shard, raw, HUGE)
    _rehash(entry["zip_data"], shard)
    (src / "index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidDataError) as got:
        ingest(src, tmp_path / "store", "bomb", progress=False)
    read = re.search(
        rf"{re.escape(shard.name)}: holds more than the {listed} bytes index\.json lists "
        r"\(refused after reading (\d+)\)",
        str(got.value),
    )
    assert read is not None, got.value
    assert listed < int(read.group(1)) <= listed + CHUNK


def test_a_snappy_shard_declaring_another_size_is_refused_before_inflating(
    built: dict[str, Any], tmp_path: Path
) -> None:
    """A snappy block says its size first: a shard whose index lists another one is
    refused on that, before a buffer of the listed size exists."""
    src, index = _copy_with_index(built, tmp_path, "snappy")
    entry = index["shards"][0]
    entry["raw_data"]["bytes"] = 64 << 20
    (src / "index.json").write_text(json.dumps(index))
    shard = re.escape(entry["zip_data"]["basename"])
    with pytest.raises(
        InvalidDataError,
        match=rf"{shard}: a \d+-byte snappy block that says it "
        rf"holds \d+ bytes; index\.json lists {64 << 20}",
    ):
        ingest(src, tmp_path / "store", "snap", progress=False)
