"""MosaicML MDS folders, written by Streaming's own ``MDSWriter`` (in ``.venv-mds``, see
``mds_writer.py``), ingested and read back through a real server and Loader: every value
equal to what Streaming's ``StreamingDataset`` yields, with images kept encoded."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardserve.proto.errors import InvalidDataError
from shardserve.server.store.ingest.run import ingest, ingest_all
from tests.formats.support import assert_same, read_all
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]
#: Streaming pins numpy<2.2 and transformers<5 (whose huggingface_hub<1 the dev extra's
#: datasets refuses), so it lives in an environment of its own; .ci/run makes it.
MDS_PYTHON = Path(os.environ.get("SHARDSERVE_MDS_PYTHON", ROOT / ".venv-mds" / "bin" / "python"))
WRITTEN = {"zstd": 40, "plain": 25, "gz": 12}

pytestmark = pytest.mark.skipif(
    not MDS_PYTHON.exists(),
    reason=f"no MosaicML Streaming environment at {MDS_PYTHON} (.ci/run makes .venv-mds)",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    src = tmp_path_factory.mktemp("mds")
    subprocess.run(
        [str(MDS_PYTHON), str(ROOT / "tests" / "formats" / "mds_writer.py"), str(src)],
        check=True, timeout=scaled(600),
    )  # fmt: skip
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
        [sys.executable, "-m", "shardserve.server", "ingest", str(built["src"] / "gz"),
         "--store", str(tmp_path), "--name", "cli", "--quiet"],
        capture_output=True, text=True, timeout=scaled(300), cwd=ROOT,
    )  # fmt: skip
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
