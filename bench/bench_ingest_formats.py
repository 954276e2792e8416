"""Ingest throughput per source format, and graph batches collated on the server
vs. torch_geometric's DataLoader.

    python bench/bench_ingest_formats.py [--quick] [--workdir DIR]

For every format ingest reads (nested ``.pt`` with ``None``, ``.pt`` chunks holding lists,
``(image, label)`` tuples, structured ``.npy``, PyG ``Data`` files, a Hugging Face
``save_to_disk`` folder, WebDataset tars, HDF5, LMDB, a Hugging Face dataset with every
feature type written by ``datasets`` itself with ``save_to_disk`` and ``to_parquet``, and
CIFAR-like samples written by MosaicML Streaming's ``MDSWriter`` and by ``litdata.optimize``),
in one run on the same page-cache-warm
files: samples/s of ``shardserve ingest`` vs. a raw read of the same files with the same
library and the same threads (the floor: ingest must at least read them). Target: ratio
>= 0.8. The HF all-types rows compare with ``datasets`` reading the same data once
(``load_from_disk`` / ``Dataset.from_parquet``, one pass of ``ds.iter(batch_size=256)``, its
default Python formatting), and the MDS and LitData rows with that library's
``StreamingDataset`` reading every sample once: no target, but a row under 1/3 is explained
in the report.

Graphs: per-file PyG ``Data`` graphs delivered as collated batches, by
``Loader(collate="graph")`` from the ingested store vs. a PyG ``Dataset`` that
``torch.load``s each file and ``torch_geometric.loader.DataLoader`` with ``num_workers`` 0 and
2 (what the graph-training teams ran). Target: >= 20x.

Prints a table and writes JSON to ``bench/results/``. Needs the ``formats`` and ``dev``
extras (h5py, lmdb, torch_geometric).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from shardserve.server.store.ingest.run import ingest

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
def _files(d: Path, suffix: str) -> list[Path]:
    return sorted(d.rglob(f"*{suffix}"))


def raw_pt(d: Path) -> None:
    with ThreadPoolExecutor(THREADS) as pool:
        for _ in pool.map(lambda p: torch.load(p, weights_only=True), _files(d, ".pt")):
            pass


def raw_pyg(d: Path) -> None:
    with ThreadPoolExecutor(THREADS) as pool:
        for _ in pool.map(lambda p: torch.load(p, weights_only=False), _files(d, ".pt")):
            pass


def raw_npy(d: Path) -> None:
    for p in _files(d, ".npy"):
        a = np.load(p, mmap_mode="r")
        for f in a.dtype.names or ():
            np.ascontiguousarray(a[f])


def raw_hf(d: Path) -> None:
    for p in _files(d, ".arrow"):
        with pa.memory_map(str(p)) as mm:
            for b in pa.ipc.open_stream(mm):
                for c in b.columns:  # into memory: a mapped view alone reads nothing
                    if pa.types.is_fixed_size_list(c.type):
                        np.array(c.flatten().to_numpy(), copy=True)
                    else:
                        c.to_pylist()


def raw_wds(d: Path) -> None:
    for p in _files(d, ".tar"):
        with tarfile.open(p) as tar:
            for m in tar:
                f = tar.extractfile(m)
                if f is not None:
                    f.read()


def raw_h5(d: Path) -> None:
    import h5py

    for p in _files(d, ".h5"):
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


def _best(fn: Callable[[], float | None], repeat: int) -> float:
    """The shortest of ``repeat`` runs; a run that times itself (another process's read)
    returns its own seconds."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        took = fn()
        best = min(best, time.perf_counter() - t0 if took is None else took)
    return best


def bench_formats(work: Path, n: int, repeat: int, only: str = "") -> dict[str, dict[str, float]]:
    out = {}
    for k, (label, (make, raw, kw)) in enumerate(FORMATS.items()):
        if only and not any(o.strip().lower() in label.lower() for o in only.split(",")):
            continue
        if make is make_mds and not MDS_PYTHON.exists():
            print(f"{label}: skipped, no MosaicML Streaming environment at {MDS_PYTHON}")
            continue
        src = work / f"src{k}"
        samples = make(src, n)
        raw(src)  # warm the page cache for both
        store = work / f"store{k}"

        def run(src: Path = src, store: Path = store, kw: dict[str, Any] = kw) -> None:
            ingest(src, store, "d", progress=False, overwrite=True, threads=THREADS, **kw)

        # Alternated, best of each: a shared machine's noise hits both alike.
        t_raw = t_ing = float("inf")
        for _ in range(repeat):
            t_raw = min(t_raw, _best(lambda src=src, raw=raw: raw(src), 1))  # type: ignore[misc]
            t_ing = min(t_ing, _best(run, 1))
        out[label] = {"samples": samples, "raw_s": t_raw, "ingest_s": t_ing, "ratio": t_raw / t_ing}
    return out


# -- graphs --------------------------------------------------------------------------------
def bench_graphs(work: Path, n: int, batch: int) -> dict[str, float]:
    from torch_geometric.data import Dataset
    from torch_geometric.loader import DataLoader

    from shardserve.client import Loader, serve_local

    src = work / "graphs"
    make_pyg(src, n)
    files = _files(src, ".pt")
    store = work / "gstore"
    ingest(src, store, "graphs", progress=False, threads=THREADS)

    class PerFile(Dataset):  # type: ignore[misc]
        def len(self) -> int:
            return len(files)

        def get(self, i: int) -> Any:
            return torch.load(files[i], weights_only=False)

    res: dict[str, float] = {}
    for workers in (0, 2):
        loader = DataLoader(PerFile(), batch_size=batch, shuffle=True, num_workers=workers)
        for _ in loader:  # warm: page cache, worker start
            break
        t0 = time.perf_counter()
        seen = sum(b.num_graphs for b in loader)
        res[f"pyg_workers{workers}_graphs_s"] = seen / (time.perf_counter() - t0)
    with serve_local(store) as url, Loader(url, "graphs", batch, collate="graph") as loader:
        for _ in loader:  # epoch 0 warms the mapping
            pass
        t0 = time.perf_counter()
        seen = 0
        for _ in range(3):
            seen += sum(int(b["ptr"].numel()) - 1 for b in loader)
        res["shardserve_graphs_s"] = seen / (time.perf_counter() - t0)
    for workers in (0, 2):
        res[f"ratio_vs_workers{workers}"] = (
            res["shardserve_graphs_s"] / res[f"pyg_workers{workers}_graphs_s"]
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument(
        "--only",
        default="",
        help="formats whose label contains one of these, comma-separated (e.g. HF,MDS)",
    )
    ap.add_argument("--no-graphs", action="store_true", help="skip the graph comparison")
    args = ap.parse_args()
    n, repeat, graphs = (400, 1, 2000) if args.quick else (4000, 3, 10000)
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench-formats-") as tmp:
        work = Path(tmp)
        formats = bench_formats(work, n, repeat, args.only)
        print(
            f"{'format':<26} {'samples':>9} {'raw read s':>11} {'ingest s':>9} {'ratio':>6}  target >= 0.8"
        )
        for label, r in formats.items():
            ok = "met" if r["ratio"] >= 0.8 else "MISSED"
            print(
                f"{label:<26} {r['samples']:>9,.0f} {r['raw_s']:>11.3f} {r['ingest_s']:>9.3f} {r['ratio']:>6.2f}  {ok}"
            )
        g: dict[str, float] = {}
        if not args.no_graphs:
            g = bench_graphs(work, graphs, 128)
            print(f"\ngraphs ({graphs} per-file PyG Data, batch 128), graphs/s:")
            for k in ("pyg_workers0_graphs_s", "pyg_workers2_graphs_s", "shardserve_graphs_s"):
                print(f"  {k:<28} {g[k]:>12,.0f}")
            for w in (0, 2):
                r = g[f"ratio_vs_workers{w}"]
                print(
                    f"  shardserve / PyG workers={w}: {r:6.1f}x  (target >= 20x: {'met' if r >= 20 else 'MISSED'})"
                )
    out_dir = Path(__file__).resolve().parent / "results"
    out_dir.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = out_dir / f"bench_ingest_formats-{stamp}.json"
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    path.write_text(
        json.dumps(
            {
                "date": stamp,
                "quick": args.quick,
                "machine": platform.platform(),
                "load": load,
                "formats": formats,
                "graphs": g,
            },
            indent=2,
        )
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
