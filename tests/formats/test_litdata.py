"""LitData ``optimize()`` folders ingested without LitData: written by LitData's own
``optimize``, read back by its ``StreamingDataset`` (what is wanted) and through a real
server and Loader (what is got), value by value."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from shardserve.proto.errors import InvalidDataError
from shardserve.server.store.ingest.litdata_chunks import is_litdata
from shardserve.server.store.ingest.run import ingest
from tests.formats.support import assert_same, read_all
from tests.support.server import ServerProc, run_server

litdata = pytest.importorskip("litdata")
Image = pytest.importorskip("PIL.Image")
#: LitData writes zstd with the ``zstd`` package; without it the tuple set is written plain.
ZSTD = importlib.util.find_spec("zstd") is not None


def mixed(i: int) -> dict[str, Any]:
    """Every common serializer, fixed and varying shapes, a nested dict and a PIL image."""
    rng = np.random.default_rng(i)
    return {
        "id": i,
        "score": i / 3,
        "caption": f"caption é {i}",
        "even": i % 2 == 0,
        "grid": rng.random((2, 3)).astype(np.float32),
        "var": rng.integers(0, 9, (i % 3 + 1, 2)).astype(np.int16),
        "flat": np.arange(i % 4 + 1, dtype=np.int32),
        "t": torch.full((2, i % 2 + 1), i, dtype=torch.float16),
        "t1": torch.arange(i % 3 + 1, dtype=torch.int64),
        "raw": bytes([i]) * (i % 5),
        "meta": {"rank": i * 2, "tokens": list(range(i % 4))},
        "img": Image.fromarray(rng.integers(0, 255, (4, 5, 3), dtype=np.uint8)),
    }


def flat(i: int) -> dict[str, Any]:
    """Text and numbers only: LitData keeps these rows as an Arrow table in the chunk."""
    return {"id": i, "name": f"n{i}", "w": i / 4, "ok": i % 3 == 0}


def pair(i: int) -> tuple[Any, ...]:
    """A tuple sample, written zstd-compressed (frames inside each chunk)."""
    return (i, np.full((2, 2), i, np.int64), torch.ones(3, 2) * i)


class Opaque:
    """Not a type LitData knows: it pickles it."""

    def __init__(self, n: int) -> None:
        self.n = n


def pickled(i: int) -> dict[str, Any]:
    return {"id": i, "obj": Opaque(i)}


def _write(out: Path, fn: Any, n: int, **kw: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LitData's own deprecation and size notes
        litdata.optimize(
            fn=fn, inputs=list(range(n)), output_dir=str(out), chunk_bytes=2000, num_workers=1, **kw
        )


def _as_want(value: Any) -> Any:
    """A StreamingDataset value as the Loader gives it back."""
    if isinstance(value, dict):
        return {k: _as_want(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_as_want(v) for v in value)
    if isinstance(value, list):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, Image.Image):
        return torch.from_numpy(np.asarray(value).copy())
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    return value


def _want(path: Path) -> list[Any]:
    with warnings.catch_warnings():
        # torch.frombuffer over LitData's read-only chunk mapping warns; the values are cloned.
        warnings.simplefilter("ignore", UserWarning)
        ds = litdata.StreamingDataset(str(path))
        return [_as_want(ds[i]) for i in range(len(ds))]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    src = tmp_path_factory.mktemp("src")
    store = tmp_path_factory.mktemp("store")
    _write(src / "mixed", mixed, 23)
    _write(src / "flat", flat, 30)
    _write(src / "pair", pair, 17, **({"compression": "zstd"} if ZSTD else {}))
    if ZSTD:
        _write(src / "whole", mixed, 23, compression="zstd", compression_level="chunk")
    want = {}
    for name in ("mixed", "flat", "pair"):
        ingest(src / name, store, name, progress=False)
        want[name] = _want(src / name)
    if ZSTD:
        # The samples of "mixed", compressed whole (LitData's StreamingDataset leaves files of
        # such chunks open, which this suite's warnings-as-errors refuses: "mixed" says them).
        ingest(src / "whole", store, "whole", progress=False)
        want["whole"] = want["mixed"]
    _wrap_whole(src / "flat", src / "flatwhole")
    ingest(src / "flatwhole", store, "flatwhole", progress=False)
    want["flatwhole"] = want["flat"]
    return {"src": src, "store": store, "want": want}


def _wrap_whole(src: Path, out: Path) -> None:
    """``src`` with each chunk made one zstd frame, as ``compression_level="chunk"`` writes
    it: here chunks of an Arrow footer after the item offsets, which LitData leaves plain."""
    out.mkdir()
    index = json.loads((src / "index.json").read_text())
    for entry in index["chunks"]:
        data = (src / entry["filename"]).read_bytes()
        entry["filename"] = entry["filename"].replace(".bin", ".zstd.bin")
        entry["chunk_bytes"] = len(data)
        (out / entry["filename"]).write_bytes(pa.compress(data, codec="zstd", asbytes=True))
    index["config"].update(compression="zstd", compression_level="chunk")
    (out / "index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def server(built: dict[str, Any]) -> Iterator[ServerProc]:
    with run_server(built["store"]) as srv:
        yield srv


@pytest.mark.parametrize("name", ["mixed", "flat", "pair", "whole", "flatwhole"])
def test_values_as_streaming_dataset_gives_them(
    built: dict[str, Any], server: ServerProc, name: str
) -> None:
    """Every sample read through the server equals LitData's own StreamingDataset sample
    (whole-file zstd chunks, inflated as a stream, included)."""
    if name not in built["want"]:
        pytest.skip("LitData writes zstd chunks only with the zstd package")
    want = built["want"][name]
    got = read_all(server.http_url, name, batch_size=5)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"{name}[{i}]")


def test_written_chunk_layouts_are_the_ones_read(built: dict[str, Any]) -> None:
    """The folders exercise the three chunk layouts: plain items, an Arrow footer, zstd frames."""
    src = built["src"]
    assert len(list((src / "mixed").glob("chunk-*.bin"))) > 1
    assert (src / "flat" / "chunk-0-0.bin").read_bytes().endswith(b"LDARW01\0")
    if ZSTD:
        assert (src / "pair" / "chunk-0-0.bin").read_bytes().startswith(b"LDFZ01\0\0")


def test_pickled_field_is_refused(tmp_path: Path) -> None:
    """A field LitData pickled is refused by name, before anything is unpickled."""
    _write(tmp_path / "pk", pickled, 4)
    with pytest.raises(InvalidDataError, match=r"index\.json: field 'obj'.*pickle.*Re-write"):
        ingest(tmp_path / "pk", tmp_path / "store", "pk", progress=False)


@pytest.mark.parametrize("cut", ["truncated", "offsets"])
def test_corrupt_chunk_is_refused(built: dict[str, Any], tmp_path: Path, cut: str) -> None:
    """A chunk cut short or with a broken offset table is refused, naming the chunk file."""
    copy = tmp_path / "mixed"
    shutil.copytree(built["src"] / "mixed", copy)
    chunk = copy / "chunk-0-1.bin"
    data = bytearray(chunk.read_bytes())
    if cut == "truncated":
        del data[-7:]
    else:
        data[8:12] = (1 << 30).to_bytes(4, "little")  # item 0 ends far past the file
    chunk.write_bytes(bytes(data))
    with pytest.raises(InvalidDataError, match=r"chunk-0-1\.bin.*(truncated|corrupt)"):
        ingest(copy, tmp_path / "store", "bad", progress=False)


def test_item_over_max_sample_bytes_is_refused(built: dict[str, Any], tmp_path: Path) -> None:
    """An item larger than --max-sample-bytes is refused from its offsets, before it is read."""
    with pytest.raises(InvalidDataError, match=r"chunk-0-0\.bin item 0: .*--max-sample-bytes 64"):
        ingest(built["src"] / "mixed", tmp_path, "big", progress=False, max_sample_bytes=64)


def test_mds_index_is_not_claimed(tmp_path: Path) -> None:
    """MosaicML MDS also writes index.json, with shards: not a LitData folder."""
    (tmp_path / "index.json").write_text(json.dumps({"shards": [], "version": 2}))
    assert not is_litdata(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"chunks": [], "config": {}}))
    assert is_litdata(tmp_path)


def test_whole_zstd_chunk_declaring_a_huge_size_is_refused_at_its_header(
    built: dict[str, Any], tmp_path: Path
) -> None:
    """A ~50 kB zstd chunk of zeros whose index says it inflates to 1.5 GiB (within twice
    its items x --max-sample-bytes) is read as a stream: refused after its first 4 bytes."""
    if not ZSTD:
        pytest.skip("LitData writes zstd chunks only with the zstd package")
    copy = tmp_path / "whole"
    shutil.copytree(built["src"] / "whole", copy)
    index = json.loads((copy / "index.json").read_text())
    entry = index["chunks"][0]
    huge = 1536 << 20
    with pa.CompressedOutputStream(str(copy / entry["filename"]), "zstd") as f:
        for _ in range(huge >> 24):
            f.write(bytes(1 << 24))
    assert (copy / entry["filename"]).stat().st_size < 100_000
    entry["chunk_bytes"] = huge
    (copy / "index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidDataError) as got:
        ingest(copy, tmp_path / "store", "bomb", progress=False)
    read = re.search(
        rf"chunk-0-0\.zstd\.bin: holds 0 items, index\.json says {entry['chunk_size']} "
        rf"\(refused after reading (\d+) of the {huge} bytes index\.json lists\)",
        str(got.value),
    )
    assert read is not None, got.value
    assert int(read.group(1)) <= 4


def test_a_chunk_linked_out_of_its_folder_is_refused(built: dict[str, Any], tmp_path: Path) -> None:
    """A chunk that is a link to a file elsewhere is refused naming the index, the chunk and
    the link's target (the check MDS shards share)."""
    copy = tmp_path / "mixed"
    shutil.copytree(built["src"] / "mixed", copy)
    outside = tmp_path / "elsewhere.bin"
    (copy / "chunk-0-1.bin").rename(outside)
    (copy / "chunk-0-1.bin").symlink_to(outside)
    with pytest.raises(
        InvalidDataError,
        match=r"index\.json lists chunk-0-1\.bin, a link to "
        r".*elsewhere\.bin outside the folder",
    ):
        ingest(copy, tmp_path / "store", "link", progress=False)
