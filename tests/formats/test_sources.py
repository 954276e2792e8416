"""More sources behind --format auto: a Hugging Face save_to_disk folder, WebDataset tars,
HDF5, LMDB, and --map (in this process and in worker processes); each read back through a
real server and Loader, equal to the source."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from shardserve.proto.errors import InvalidDataError
from shardserve.server.store.ingest.extras import require
from shardserve.server.store.ingest.run import ingest
from tests.formats.mapfns import to_graph
from tests.formats.support import assert_same, read_all
from tests.support.server import ServerProc, run_server

h5py = pytest.importorskip("h5py")
lmdb = pytest.importorskip("lmdb")


def _hf_folder(path: Path) -> list[dict[str, Any]]:
    """A folder laid out exactly as datasets' save_to_disk writes it (checked against
    datasets 5.2.0): Arrow *stream* files listed in state.json, beside dataset_info.json."""
    path.mkdir()
    rows = [
        {
            "text": f"t{i}" if i % 4 else None,
            "label": i % 3,
            "emb": [float(j) for j in range(i % 5 + 1)],
            "meta": {"id": i, "w": 0.5 * i if i % 2 else None},
        }
        for i in range(25)
    ]
    schema = pa.schema(
        [
            ("text", pa.string()),
            ("label", pa.int64()),
            ("emb", pa.list_(pa.float64())),
            ("meta", pa.struct([("id", pa.int64()), ("w", pa.float64())])),
        ]
    )
    names = []
    for k, part in enumerate((rows[:12], rows[12:])):
        name = f"data-{k:05d}-of-00002.arrow"
        with pa.OSFile(str(path / name), "wb") as f, pa.ipc.new_stream(f, schema) as w:
            w.write_table(pa.Table.from_pylist(part, schema=schema), max_chunksize=5)
        names.append({"filename": name})
    (path / "state.json").write_text(
        json.dumps(
            {
                "_data_files": names,
                "_fingerprint": "x",
                "_format_columns": None,
                "_format_kwargs": {},
                "_format_type": None,
                "_output_all_columns": False,
                "_split": None,
            }
        )
    )
    (path / "dataset_info.json").write_text(json.dumps({"features": {}}))
    want = []
    for r in rows:
        want.append(
            {
                "text": r["text"],
                "label": torch.tensor(r["label"]),
                "emb": torch.tensor(r["emb"], dtype=torch.float64),
                "meta": {
                    "id": torch.tensor(r["meta"]["id"]),
                    "w": torch.tensor(r["meta"]["w"], dtype=torch.float64)
                    if r["meta"]["w"] is not None
                    else None,
                },
            }
        )
    return want


def _wds(path: Path) -> list[dict[str, Any]]:
    path.mkdir()
    want = []
    for shard in range(2):
        with tarfile.open(path / f"shard-{shard:04d}.tar", "w") as tar:
            for i in range(shard * 10, shard * 10 + 10):
                key = f"s{i:05d}"
                img = bytes([i]) * (i + 3)  # stands in for an encoded image: stays bytes
                arr = np.arange(i % 4 + 2, dtype=np.float32)
                buf = io.BytesIO()
                np.save(buf, arr)
                for ext, data in (
                    ("jpg", img),
                    ("cls", str(i % 7).encode()),
                    ("feat.npy", buf.getvalue()),
                ):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                want.append(
                    {
                        "__key__": key.encode(),
                        "jpg": img,
                        "cls": torch.tensor(i % 7),
                        "feat.npy": torch.from_numpy(arr),
                    }
                )
    return want


def _h5(path: Path) -> list[dict[str, Any]]:
    path.mkdir()
    want = []
    for f in range(2):
        x = np.random.default_rng(f).random((30, 4, 2), dtype=np.float32)
        y = np.arange(30, dtype=np.int32) + 30 * f
        with h5py.File(path / f"part{f}.h5", "w") as h:
            h.create_dataset("x", data=x, chunks=(8, 4, 2))
            h.create_group("labels").create_dataset("y", data=y)
        want += [
            {"labels": {"y": torch.tensor(y[i])}, "x": torch.from_numpy(x[i])} for i in range(30)
        ]
    return want


def _lmdb(path: Path) -> list[Any]:
    env = lmdb.open(str(path), map_size=1 << 24)
    want = []
    with env.begin(write=True) as txn:
        for i in range(15):
            sample = {"img": torch.full((2, 2), i, dtype=torch.uint8), "label": torch.tensor(i)}
            buf = io.BytesIO()
            torch.save(sample, buf)
            txn.put(f"{i:06d}".encode(), buf.getvalue())
            want.append(sample)
    env.close()
    return want


def _crystals(path: Path) -> list[dict[str, Any]]:
    path.mkdir()
    raw = []
    for i in range(12):
        g = torch.Generator().manual_seed(i)
        s = {"pos": torch.rand(i % 5 + 2, 3, generator=g) * 2, "id": torch.tensor(i)}
        torch.save(s, path / f"{i:03d}.pt")
        raw.append(s)
    want = []
    for s in raw:
        g = to_graph({"pos": s["pos"].numpy(), "id": s["id"].numpy()})
        want.append({k: torch.from_numpy(np.asarray(v)) for k, v in g.items()})
    return want


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    src = tmp_path_factory.mktemp("src")
    store = tmp_path_factory.mktemp("store")
    out: dict[str, Any] = {"store": store, "want": {}, "summary": {}}
    makers = {"hf": _hf_folder, "wds": _wds, "h5": _h5, "lmdb": _lmdb, "mapped": _crystals}
    for name, make in makers.items():
        out["want"][name] = make(src / name)
        kw: dict[str, Any] = {"map_fn": "tests.formats.mapfns:to_graph"} if name == "mapped" else {}
        out["summary"][name] = ingest(
            src / name, store, name, progress=False, shard_bytes=1024, **kw
        )
    out["summary"]["mapped2"] = ingest(
        src / "mapped",
        store,
        "mapped2",
        progress=False,
        map_fn="tests.formats.mapfns:to_graph",
        workers=2,
    )
    out["want"]["mapped2"] = out["want"]["mapped"]
    out["src"] = src
    return out


@pytest.fixture(scope="module")
def server(built: dict[str, Any]) -> Iterator[ServerProc]:
    with run_server(built["store"]) as srv:
        yield srv


@pytest.mark.parametrize("name", ["hf", "wds", "h5", "lmdb", "mapped", "mapped2"])
def test_every_sample_reads_back_equal(
    built: dict[str, Any], server: ServerProc, name: str
) -> None:
    """Every source sample comes back through the Loader, in order, equal to the source."""
    got = read_all(server.http_url, name, batch_size=6)
    want = built["want"][name]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"{name}[{i}]")


def test_formats_detected(built: dict[str, Any]) -> None:
    """--format auto picked each source's format."""
    fmts = {k: s.manifest.source["format"] for k, s in built["summary"].items()}
    assert fmts == {
        "hf": "hf",
        "wds": "webdataset",
        "h5": "hdf5",
        "lmdb": "lmdb",
        "mapped": "pt",
        "mapped2": "pt",
    }


def test_map_failure_names_file_and_sample(built: dict[str, Any], tmp_path: Path) -> None:
    """A --map function that raises names the file and the error; nothing is published."""
    for workers in (0, 2):
        with pytest.raises(
            InvalidDataError,
            match=r"007\.pt: --map .*fail_on_seven failed: ValueError: bad crystal",
        ):
            ingest(
                built["src"] / "mapped",
                tmp_path,
                "m",
                progress=False,
                map_fn="tests.formats.mapfns:fail_on_seven",
                workers=workers,
            )
        assert not (tmp_path / "m").exists()


def test_map_may_drop_samples(built: dict[str, Any], tmp_path: Path) -> None:
    """A --map function returning None drops that sample."""
    s = ingest(
        built["src"] / "mapped",
        tmp_path,
        "m",
        progress=False,
        map_fn="tests.formats.mapfns:drop_odd",
    )
    assert s.manifest.num_samples == 6


def test_bad_map_name_is_a_clear_error(built: dict[str, Any], tmp_path: Path) -> None:
    """--map names that do not resolve say what to change."""
    with pytest.raises(InvalidDataError, match="MODULE:FUNCTION"):
        ingest(built["src"] / "mapped", tmp_path, "m", progress=False, map_fn="nocolon")
    with pytest.raises(InvalidDataError, match="has no function 'nope'"):
        ingest(
            built["src"] / "mapped",
            tmp_path,
            "m",
            progress=False,
            map_fn="tests.formats.mapfns:nope",
        )


def test_missing_optional_package_names_the_extra() -> None:
    """A reader whose package is absent says which extra to install."""
    with pytest.raises(InvalidDataError, match=r"pip install 'shardserve\[formats\]'"):
        require("no_such_module_for_shardserve", "HDF5")


def test_progress_bar_ends_with_the_real_counts(
    built: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bar's last postfix shows every file and sample, as the summary does."""
    s = ingest(built["src"] / "mapped", tmp_path, "p", progress=True)
    err = capsys.readouterr().err
    assert f"12/12 files, {s.manifest.num_samples} samples" in err.rsplit("\r", 1)[-1]
