"""The sources of ``bench_ingest_formats.py``: for each format ingest reads, a writer of
``n`` samples in it (``make_*``, by the format's own library) and the raw read of those files
with the same library and threads (``raw_*``, the floor ingest is measured against), and the
table of them (:data:`FORMATS`).

::

    make, raw, kw = FORMATS["HDF5"]
    samples = make(Path("/tmp/src"), 1_000)
    raw(Path("/tmp/src"))
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

THREADS = 2
#: Columnar sources get more rows per "sample count", so that their tens of MB, not an
#: ingest's fixed cost (open, fsync, checksum, manifest), decide the ratio.
COLUMNAR_ROWS_PER_N = 500


# -- sources -------------------------------------------------------------------------------
def _nested(i: int, rng: np.random.Generator) -> dict[str, Any]:
    return {
        "latent": torch.from_numpy(rng.random((16, 16), dtype=np.float32)),
        "params": None if i % 3 == 0 else {"nu": torch.tensor(0.1 * i), "re": torch.rand(4)},
    }


def make_pt_nested(d: Path, n: int) -> int:
    d.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        torch.save(_nested(i, rng), d / f"{i:06d}.pt")
    return n


def make_pt_tuples(d: Path, n: int) -> int:
    d.mkdir()
    rng = np.random.default_rng(1)
    for i in range(n):
        torch.save(
            (torch.from_numpy(rng.integers(0, 256, (3, 32, 32), dtype=np.uint8)), i % 10),
            d / f"{i:06d}.pt",
        )
    return n


def make_pt_chunked(d: Path, n: int) -> int:
    d.mkdir()
    per = 1000
    for f in range(0, n, per):
        g = torch.Generator().manual_seed(f)
        torch.save(
            [
                {"pos": torch.rand(3, generator=g), "z": torch.tensor(i)}
                for i in range(f, min(n, f + per))
            ],
            d / f"chunk{f:06d}.pt",
        )
    return n


def make_npy_records(d: Path, n: int) -> int:
    d.mkdir()
    dt = np.dtype([("board", "u1", (32,)), ("eval", "<i2"), ("move", "<u2"), ("result", "u1")])
    rows = n * COLUMNAR_ROWS_PER_N
    a = np.zeros(rows, dtype=dt)
    a["board"] = np.random.default_rng(2).integers(0, 13, (rows, 32))
    np.save(d / "games.npy", a)
    return rows


def _graph(i: int) -> Any:
    from torch_geometric.data import Data

    g = torch.Generator().manual_seed(i)
    nodes = int(torch.randint(8, 40, (1,), generator=g))
    edges = int(torch.randint(16, 120, (1,), generator=g))
    return Data(
        x=torch.randn(nodes, 16, generator=g),
        edge_index=torch.randint(0, nodes, (2, edges), generator=g),
        y=torch.tensor([float(i % 2)]),
    )


def make_pyg(d: Path, n: int) -> int:
    d.mkdir()
    for i in range(n):
        torch.save(_graph(i), d / f"{i:06d}.pt")
    return n


def make_hf(d: Path, n: int) -> int:
    d.mkdir()
    rng = np.random.default_rng(3)
    schema = pa.schema(
        [("text", pa.string()), ("label", pa.int64()), ("emb", pa.list_(pa.float32(), 64))]
    )
    rows = n * COLUMNAR_ROWS_PER_N // 4
    emb = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(rows * 64, dtype=np.float32)), 64)
    table = pa.table(
        [pa.array([f"text {i}" for i in range(rows)]), pa.array(np.arange(rows) % 7), emb],
        schema=schema,
    )
    with (
        pa.OSFile(str(d / "data-00000-of-00001.arrow"), "wb") as f,
        pa.ipc.new_stream(f, schema) as w,
    ):
        w.write_table(table, max_chunksize=1000)
    (d / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (d / "dataset_info.json").write_text("{}")
    return rows


def _hf_all_types(n: int) -> Any:
    """A ``datasets.Dataset`` with every feature type ingest reads, written by ``datasets``."""
    import datasets as hf
    from PIL import Image

    rows = n * 5
    rng = np.random.default_rng(5)
    pngs = []
    for _ in range(16):
        b = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(b, format="PNG")
        pngs.append(b.getvalue())
    feats = hf.Features(
        {
            "a2": hf.Array2D((4, 8), "float32"),
            "a3": hf.Array3D((2, 4, 4), "int32"),
            "seqseq": hf.Sequence(hf.Sequence(hf.Value("float32"))),
            "strs": hf.Sequence(hf.Value("string")),
            "sdict": hf.Sequence({"p": hf.Value("int64"), "q": hf.Value("float32")}),
            "img": hf.Image(),
            "aud": {"bytes": hf.Value("binary"), "path": hf.Value("string")},
            "lab": hf.ClassLabel(names=["a", "b", "c"]),
            "txt": hf.Value("string"),
            "nest": {"u": {"v": hf.Value("int16")}},
        }
    )
    cols = {
        "a2": [np.full((4, 8), i, np.float32) for i in range(rows)],
        "a3": [np.full((2, 4, 4), i, np.int32) for i in range(rows)],
        "seqseq": [[[float(i)] * 3] * (i % 4 + 1) for i in range(rows)],
        "strs": [[f"w{i}", "x"][: i % 3] for i in range(rows)],
        "sdict": [{"p": [i] * (i % 3 + 1), "q": [0.5] * (i % 3 + 1)} for i in range(rows)],
        "img": [{"bytes": pngs[i % 16], "path": None} for i in range(rows)],
        "aud": [{"bytes": pngs[i % 16][:32], "path": None} for i in range(rows)],
        "lab": [i % 3 for i in range(rows)],
        "txt": [f"sentence number {i}" for i in range(rows)],
        "nest": [{"u": {"v": i % 1000}} for i in range(rows)],
    }
    ds = hf.Dataset.from_dict(cols, features=feats)
    return ds.cast_column("aud", hf.Audio(decode=False)), rows


def make_hf_all_disk(d: Path, n: int) -> int:
    ds, rows = _hf_all_types(n)
    ds.save_to_disk(str(d))
    return int(rows)


def make_hf_all_parquet(d: Path, n: int) -> int:
    ds, rows = _hf_all_types(n)
    d.mkdir()
    ds.to_parquet(str(d / "train.parquet"))
    return int(rows)


def _iterate_hf(ds: Any) -> None:
    """One pass as a user reads it with ``datasets``: Python rows, 256 at a time (its default
    formatting, which decodes the images with PIL)."""
    for _ in ds.iter(batch_size=256):
        pass


def raw_hf_all_disk(d: Path) -> None:
    import datasets as hf

    _iterate_hf(hf.load_from_disk(str(d)))


def raw_hf_all_parquet(d: Path) -> None:
    import datasets as hf

    # Dataset.from_parquet converts into datasets' Arrow cache first: what a first read costs.
    _iterate_hf(hf.Dataset.from_parquet(str(d / "train.parquet"), keep_in_memory=True))


def make_wds(d: Path, n: int) -> int:
    d.mkdir()
    rng = np.random.default_rng(4)
    per = 1000
    for s in range(0, n, per):
        with tarfile.open(d / f"shard-{s:06d}.tar", "w") as tar:
            for i in range(s, min(n, s + per)):
                for ext, data in (("jpg", rng.bytes(3000)), ("cls", str(i % 10).encode())):
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return n


def make_h5(d: Path, n: int) -> int:
    import h5py

    d.mkdir()
    rows = n * COLUMNAR_ROWS_PER_N // 4
    with h5py.File(d / "data.h5", "w") as h:
        h.create_dataset(
            "x",
            data=np.random.default_rng(5).random((rows, 64), dtype=np.float32),
            chunks=(1024, 64),
        )
        h.create_dataset("y", data=np.arange(rows, dtype=np.int64))
    return rows


def make_lmdb(d: Path, n: int) -> int:
    import lmdb

    env = lmdb.open(str(d), map_size=1 << 30)
    rng = np.random.default_rng(6)
    with env.begin(write=True) as txn:
        for i in range(n):
            buf = io.BytesIO()
            torch.save(
                {
                    "img": torch.from_numpy(rng.integers(0, 256, (3, 32, 32), dtype=np.uint8)),
                    "label": torch.tensor(i % 10),
                },
                buf,
            )
            txn.put(f"{i:08d}".encode(), buf.getvalue())
    env.close()
    return n


# -- raw reads (the floor) -----------------------------------------------------------------
def source_files(d: Path, suffix: str) -> list[Path]:
    return sorted(d.rglob(f"*{suffix}"))


def raw_pt(d: Path) -> None:
    with ThreadPoolExecutor(THREADS) as pool:
        for _ in pool.map(lambda p: torch.load(p, weights_only=True), source_files(d, ".pt")):
            pass


def raw_pyg(d: Path) -> None:
    with ThreadPoolExecutor(THREADS) as pool:
        for _ in pool.map(lambda p: torch.load(p, weights_only=False), source_files(d, ".pt")):
            pass


def raw_npy(d: Path) -> None:
    for p in source_files(d, ".npy"):
        a = np.load(p, mmap_mode="r")
        for f in a.dtype.names or ():
            np.ascontiguousarray(a[f])


def raw_hf(d: Path) -> None:
    for p in source_files(d, ".arrow"):
        with pa.memory_map(str(p)) as mm:
            for b in pa.ipc.open_stream(mm):
                for c in b.columns:  # into memory: a mapped view alone reads nothing
                    if pa.types.is_fixed_size_list(c.type):
                        np.array(c.flatten().to_numpy(), copy=True)
                    else:
                        c.to_pylist()


def raw_wds(d: Path) -> None:
    for p in source_files(d, ".tar"):
        with tarfile.open(p) as tar:
            for m in tar:
                f = tar.extractfile(m)
                if f is not None:
                    f.read()


def raw_h5(d: Path) -> None:
    import h5py

    for p in source_files(d, ".h5"):
        with h5py.File(p, "r") as h:
            n = h["x"].shape[0]
            for s in range(0, n, 65536):
                h["x"][s : s + 65536]
                h["y"][s : s + 65536]


def raw_lmdb(d: Path) -> None:
    import lmdb

    env = lmdb.open(str(d), readonly=True, lock=False)
    with env.begin() as txn:
        for _k, v in txn.cursor():
            torch.load(io.BytesIO(v), weights_only=True)
    env.close()


#: The Python of MosaicML Streaming's own environment (its pins conflict with the dev extra).
MDS_PYTHON = Path(
    os.environ.get("SHARDSERVE_MDS_PYTHON", Path(__file__).parents[1] / ".venv-mds/bin/python")
)


def _mds_side(*args: str) -> str:
    side = Path(__file__).with_name("mds_side.py")
    out = subprocess.run(
        [str(MDS_PYTHON), str(side), *args],
        check=True,
        text=True,
        capture_output=True,
        timeout=1800,
    )
    return out.stdout


def make_mds(d: Path, n: int) -> int:
    _mds_side("write", str(d), str(n * 10))
    return n * 10


def raw_mds(d: Path) -> float:
    """Streaming's ``StreamingDataset`` reading every sample once, timed in its own process
    (so its interpreter start and imports are not counted)."""
    return float(_mds_side("read", str(d)).strip())


def _litdata_sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    return {"x": rng.integers(0, 256, (3, 32, 32), dtype=np.uint8), "y": i % 10}


def make_litdata(d: Path, n: int) -> int:
    import warnings

    import litdata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LitData's own notes
        litdata.optimize(
            fn=_litdata_sample,
            inputs=list(range(n * 10)),
            output_dir=str(d),
            chunk_bytes="64MB",
            num_workers=1,
        )
    return n * 10


def raw_litdata(d: Path) -> None:
    import litdata

    for _ in litdata.StreamingDataset(str(d)):  # as a training loop reads it
        pass


FORMATS: dict[
    str, tuple[Callable[[Path, int], int], Callable[[Path], float | None], dict[str, Any]]
] = {
    "pt nested dict + None": (make_pt_nested, raw_pt, {}),
    "pt (image, label) tuple": (make_pt_tuples, raw_pt, {}),
    "pt list of 1000 / file": (make_pt_chunked, raw_pt, {}),
    "npy structured records": (make_npy_records, raw_npy, {}),
    "pt PyG Data": (make_pyg, raw_pyg, {}),
    "HF save_to_disk": (make_hf, raw_hf, {}),
    "WebDataset tar": (make_wds, raw_wds, {}),
    "HDF5": (make_h5, raw_h5, {}),
    "LMDB (.pt values)": (make_lmdb, raw_lmdb, {}),
    "HF all types save_to_disk": (make_hf_all_disk, raw_hf_all_disk, {}),
    "HF all types to_parquet": (make_hf_all_parquet, raw_hf_all_parquet, {}),
    "MDS (MDSWriter)": (make_mds, raw_mds, {}),
    "LitData (optimize)": (make_litdata, raw_litdata, {}),
}
