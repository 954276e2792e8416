"""Members and values decoded as their libraries decode them: WebDataset ``.json`` as nested
fields and ``.txt`` / ``.cls`` as str / int (written by webdataset's own ShardWriter and
compared with what its default decoders give), LMDB values by ``--value-format``."""

from __future__ import annotations

import gc
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shardserve.proto.errors import InvalidDataError
from shardserve.server.store.ingest.run import ingest
from tests.formats.support import assert_same, read_all
from tests.support.server import ServerProc, run_server

wds = pytest.importorskip("webdataset")
lmdb = pytest.importorskip("lmdb")
msgpack = pytest.importorskip("msgpack")


def _as_want(value: Any) -> Any:
    """A decoded webdataset / JSON value as the Loader gives it back."""
    if isinstance(value, dict):
        return {k: _as_want(v) for k, v in value.items()}
    if isinstance(value, list):
        return torch.from_numpy(
            np.array(
                value, dtype=np.float64 if any(isinstance(v, float) for v in value) else np.int64
            )
        )
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    return value


def _write_wds(path: Path) -> list[dict[str, Any]]:
    path.mkdir()
    with wds.ShardWriter(str(path / "shard-%04d.tar"), maxcount=7) as sink:
        for i in range(16):
            sink.write(
                {
                    "__key__": f"k{i:04d}",
                    "json": {
                        "id": i,
                        "score": i / 4,
                        "tags": [i, i + 1],
                        "meta": {"ok": i % 2 == 0},
                    },
                    "txt": f"caption é {i}",
                    "cls": i % 5,
                }
            )
    want = []
    # webdataset leaves its shard files to the garbage collector: not ours to fail on.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        urls = str(path / "shard-{0000..0002}.tar")
        for s in wds.WebDataset(urls, shardshuffle=False).decode():
            want.append(
                {
                    "__key__": s["__key__"].encode(),
                    **{k: _as_want(s[k]) for k in ("cls", "json", "txt")},  # tar order
                }
            )
        gc.collect()
    return want


def _write_lmdb(path: Path, fmt: str) -> list[dict[str, Any]]:
    env = lmdb.open(str(path), map_size=1 << 24)
    want = []
    with env.begin(write=True) as txn:
        for i in range(11):
            value = {"x": [float(i), 2.0 * i], "label": i % 3, "name": f"n{i}"}
            data = msgpack.packb(value) if fmt == "msgpack" else json.dumps(value).encode()
            txn.put(f"{i:05d}".encode(), data)
            want.append(_as_want(value))
        txn.put(b"__len__", b"11")
    env.close()
    return want


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    src = tmp_path_factory.mktemp("src")
    store = tmp_path_factory.mktemp("store")
    want = {"wds": _write_wds(src / "wds")}
    ingest(src / "wds", store, "wds", progress=False)
    for fmt in ("msgpack", "json"):
        want[fmt] = _write_lmdb(src / fmt, fmt)
        ingest(src / fmt, store, fmt, progress=False, value_format=fmt)
    # No --value-format: msgpack maps are told from the first value.
    detected = ingest(src / "msgpack", store, "msgpack-auto", progress=False)
    want["msgpack-auto"] = want["msgpack"]
    return {"store": store, "want": want, "src": src, "detected": detected.line()}


@pytest.fixture(scope="module")
def server(built: dict[str, Any]) -> Iterator[ServerProc]:
    with run_server(built["store"]) as srv:
        yield srv


@pytest.mark.parametrize("name", ["wds", "msgpack", "json", "msgpack-auto"])
def test_decoded_as_the_library_decodes(
    built: dict[str, Any], server: ServerProc, name: str
) -> None:
    got = read_all(server.http_url, name, batch_size=5)
    want = built["want"][name]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"{name}[{i}]")


def test_value_format_names_the_bad_value(built: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(InvalidDataError, match=r"key b'00000'.*not valid JSON"):
        ingest(built["src"] / "msgpack", tmp_path, "bad", progress=False, value_format="json")
    with pytest.raises(InvalidDataError, match="--value-format applies to LMDB values"):
        ingest(built["src"] / "wds", tmp_path, "bad", progress=False, value_format="json")


def test_msgpack_values_are_detected_and_the_summary_says_so(built: dict[str, Any]) -> None:
    """LMDB values written by ``msgpack.packb(dict)`` are read as msgpack without
    ``--value-format`` (values compared in test_decoded_as_the_library_decodes), and the
    ingest summary says they were detected and which flag keeps the bytes."""
    line = built["detected"]
    assert "values read as msgpack maps (detected; --value-format raw keeps the bytes)" in line


def _lmdb_of(path: Path, values: list[bytes]) -> Path:
    env = lmdb.open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i, v in enumerate(values):
            txn.put(f"{i:05d}".encode(), v)
    env.close()
    return path


def test_raw_values_summary_names_the_value_format_flag(tmp_path: Path) -> None:
    """Values that are no format ingest tells (here text) stay bytes, and the summary names
    --value-format; a msgpack environment with one value that is not msgpack is refused
    naming that key and the flag, never half raw, half decoded."""
    raw = _lmdb_of(tmp_path / "raw", [f"caption {i}".encode() for i in range(5)])
    line = ingest(raw, tmp_path / "store", "raw", progress=False).line()
    assert "values kept as bytes (field value)" in line and "--value-format msgpack" in line
    mixed = [msgpack.packb({"x": i}) for i in range(3)] + [b"\x89PNG not msgpack"]
    src = _lmdb_of(tmp_path / "mixed", mixed)
    with pytest.raises(InvalidDataError, match=r"key b'00003'.*not a msgpack map.*--value-format"):
        ingest(src, tmp_path / "store", "mixed", progress=False)
