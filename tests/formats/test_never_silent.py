"""Sources that used to ingest as the wrong dataset and say it succeeded: splits merged, a
metadata key or array made a sample, a PyG InMemoryDataset read as one sample, two inputs
flattened to one field. Each source is written by its real library (datasets, lmdb, h5py,
torch_geometric) and read back through a real server and Loader."""

from __future__ import annotations

import io
import json
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shardserve.proto.errors import InvalidDataError
from shardserve.server.store.ingest.run import ingest, ingest_all
from tests.formats.support import assert_same, read_all
from tests.support.server import ServerProc, run_server

datasets = pytest.importorskip("datasets")
h5py = pytest.importorskip("h5py")
lmdb = pytest.importorskip("lmdb")
pyg_data = pytest.importorskip("torch_geometric.data")


def _rows(n: int, start: int) -> dict[str, list[Any]]:
    return {"x": [float(start + i) for i in range(n)], "label": [(start + i) % 3 for i in range(n)]}


def _hub_layout(path: Path) -> None:
    """``data/train-00000-of-00001.parquet`` + ``data/test-...``: the Hub's layout."""
    (path / "data").mkdir(parents=True)
    datasets.Dataset.from_dict(_rows(30, 0)).to_parquet(
        str(path / "data" / "train-00000-of-00001.parquet")
    )
    datasets.Dataset.from_dict(_rows(10, 100)).to_parquet(
        str(path / "data" / "test-00000-of-00001.parquet")
    )


def _dataset_dict(path: Path) -> None:
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_dict(_rows(30, 0)),
        test=datasets.Dataset.from_dict(_rows(10, 100)),
    )
    dd.save_to_disk(str(path))


def _split_folders(path: Path) -> None:
    for split, (n, start) in {"train": (30, 0), "test": (10, 100)}.items():
        (path / split).mkdir(parents=True)
        datasets.Dataset.from_dict(_rows(n, start)).to_parquet(str(path / split / "0.parquet"))


def _want(n: int, start: int) -> list[dict[str, Any]]:
    r = _rows(n, start)
    return [
        {"x": torch.tensor(x, dtype=torch.float64), "label": torch.tensor(y)}
        for x, y in zip(r["x"], r["label"], strict=True)
    ]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProc]:
    with run_server(store) as srv:
        yield srv


LAYOUTS = {"hub": _hub_layout, "dd": _dataset_dict, "folders": _split_folders}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_splits_become_datasets_of_their_own(
    layout: str, tmp_path: Path, store: Path, server: ServerProc
) -> None:
    """Each split is its own dataset NAME-split, equal to that split, and the summary says so;
    --split picks one; ingest() without a split refuses to guess."""
    src = tmp_path / layout
    LAYOUTS[layout](src)
    report = ingest_all(src, store, f"s{layout}", progress=False)
    names = sorted(s.manifest.name for s in report.summaries)
    assert names == [f"s{layout}-test", f"s{layout}-train"]
    assert sorted(report.splits) == ["test", "train"]
    assert ": each ingested as its own dataset" in report.line()
    for split, (n, start) in {"train": (30, 0), "test": (10, 100)}.items():
        got = read_all(server.http_url, f"s{layout}-{split}")
        want = _want(n, start)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{layout}/{split}[{i}]")
    one = ingest_all(src, store, f"p{layout}", split="test", progress=False)
    assert [s.manifest.num_samples for s in one.summaries] == [10]
    assert one.summaries[0].manifest.source["split"] == "test"
    with pytest.raises(InvalidDataError, match=r"has splits (test, train|train, test)"):
        ingest(src, store, f"q{layout}", progress=False)
    with pytest.raises(InvalidDataError, match=r"--split 'valid'.*has splits"):
        ingest(src, store, f"q{layout}", split="valid", progress=False)


def test_a_file_outside_every_split_is_refused(tmp_path: Path, store: Path) -> None:
    """With splits, a stray file would be left out or merged: refused, named."""
    _hub_layout(tmp_path / "hub")
    datasets.Dataset.from_dict(_rows(3, 0)).to_parquet(str(tmp_path / "hub" / "data" / "x.parquet"))
    with pytest.raises(InvalidDataError, match=r"data/x\.parquet belongs to none"):
        ingest_all(tmp_path / "hub", store, "stray", progress=False)


def test_lmdb_metadata_keys_are_not_samples(
    tmp_path: Path, store: Path, server: ServerProc
) -> None:
    """``__len__`` / ``__keys__`` beside 12 samples: 12 samples, the keys listed as metadata
    (the pickled one is never loaded)."""
    env = lmdb.open(str(tmp_path / "db"), map_size=1 << 24)
    want = []
    with env.begin(write=True) as txn:
        for i in range(12):
            s = {"v": torch.full((3,), i, dtype=torch.int16)}
            buf = io.BytesIO()
            torch.save(s, buf)
            txn.put(f"{i:04d}".encode(), buf.getvalue())
            want.append(s)
        txn.put(b"__len__", b"12")
        txn.put(b"__keys__", pickle.dumps([f"{i:04d}".encode() for i in range(12)]))
    env.close()
    s = ingest(tmp_path / "db", store, "lm", progress=False)
    assert s.manifest.num_samples == 12
    assert s.manifest.source["meta.__len__"] == "12"
    assert "meta.__keys__" not in s.manifest.source
    assert "not samples: __keys__ (" in s.line() and "__len__ (kept" in s.line()
    got = read_all(server.http_url, "lm")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"lm[{i}]")


def test_hdf5_arrays_without_the_sample_dimension_are_metadata(
    tmp_path: Path, store: Path, server: ServerProc
) -> None:
    """A 10-row ``class_names`` beside 40-row per-sample datasets: the file ingests; the
    names and the file's attributes go in the manifest, not in any sample."""
    x = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    y = np.arange(40, dtype=np.int64) % 10
    names = [f"class{i}" for i in range(10)]
    with h5py.File(tmp_path / "f.h5", "w") as h:
        h.create_dataset("x", data=x)
        h.create_dataset("y", data=y)
        h.create_dataset("class_names", data=np.array(names, dtype="S"))
        h.create_dataset("mean", data=np.float64(0.5))
        h.attrs["version"] = 3
    s = ingest(tmp_path / "f.h5", store, "h5m", progress=False)
    assert s.manifest.num_samples == 40
    assert [f.name for f in s.manifest.fields] == ["x", "y"]
    assert json.loads(s.manifest.source["meta.class_names"]) == names
    assert json.loads(s.manifest.source["meta.mean"]) == 0.5
    assert json.loads(s.manifest.source["meta.@version"]) == 3
    assert "not samples: class_names (" in s.line()
    got = read_all(server.http_url, "h5m")
    for i, g in enumerate(got):
        assert_same(g, {"x": torch.from_numpy(x[i]), "y": torch.tensor(y[i])}, f"h5m[{i}]")


def test_hdf5_names_that_collide_are_refused(tmp_path: Path, store: Path) -> None:
    """Dataset ``a.b`` beside group ``a`` / dataset ``b``: one field name, both named."""
    with h5py.File(tmp_path / "c.h5", "w") as h:
        h.create_dataset("a.b", data=np.zeros(4))
        h.create_group("a").create_dataset("b", data=np.ones(4))
    with pytest.raises(InvalidDataError, match=r"'a/b' and 'a\.b' both become the field 'a\.b'"):
        ingest(tmp_path / "c.h5", store, "coll", progress=False)
    assert not (store / "coll").exists()


def test_hf_struct_beside_a_dotted_column_is_refused(tmp_path: Path, store: Path) -> None:
    """An HF struct ``a{b}`` beside a column ``a.b``: refused naming both."""
    ds = datasets.Dataset.from_dict({"a": [{"b": 1}, {"b": 2}], "a.b": [3, 4]})
    ds.save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(InvalidDataError, match=r"both become the field 'a\.b'") as e:
        ingest(tmp_path / "hf", store, "coll2", progress=False)
    assert "a['b']" in str(e.value)


def test_npz_record_beside_a_dotted_array_is_refused(tmp_path: Path, store: Path) -> None:
    """A folder of .npy: record array ``a`` (field ``b``) beside array ``a.b``."""
    (tmp_path / "n").mkdir()
    np.save(tmp_path / "n" / "a.npy", np.zeros(4, dtype=[("b", "f4")]))
    np.save(tmp_path / "n" / "a.b.npy", np.ones(4, dtype=np.float32))
    with pytest.raises(InvalidDataError, match=r"'a\.b' and \"a\['b'\]\" both become the field"):
        ingest(tmp_path / "n", store, "coll3", progress=False)


def _graphs(n: int) -> list[Any]:
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        k = i % 4 + 2
        e = torch.randint(0, k, (2, i % 5 + 1), generator=g)
        out.append(
            pyg_data.Data(
                x=torch.rand(k, 3, generator=g),
                edge_index=e,
                y=torch.tensor([i % 2]),
                pos=torch.rand(k, 2, generator=g),
            )
        )
    return out


class _Mem(pyg_data.InMemoryDataset):  # type: ignore[misc]
    def __init__(self, root: str, graphs: list[Any], old: bool) -> None:
        self._graphs, self._old = graphs, old
        super().__init__(root, log=False)
        self.load(self.processed_paths[0])

    @property
    def processed_file_names(self) -> list[str]:
        return ["data.pt"]

    def process(self) -> None:
        if self._old:  # the (data, slices) layout most saved datasets still have
            torch.save(self.collate(self._graphs), self.processed_paths[0])
        else:
            self.save(self._graphs, self.processed_paths[0])


@pytest.mark.parametrize("old", [False, True], ids=["save", "data_slices"])
def test_pyg_in_memory_dataset_reads_as_its_graphs(
    old: bool, tmp_path: Path, store: Path, server: ServerProc
) -> None:
    """processed/data.pt is one sample per graph, equal to dataset[i] for every i."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = _Mem(str(tmp_path / "pyg"), _graphs(17), old)
    name = f"mem{int(old)}"
    s = ingest(tmp_path / "pyg" / "processed" / "data.pt", store, name, progress=False)
    assert s.manifest.num_samples == len(ds) == 17
    got = read_all(server.http_url, name)
    for i, g in enumerate(got):
        d = ds[i]
        want = {k: d[k] for k in ("x", "edge_index", "y", "pos")}
        want["num_nodes"] = torch.tensor(d.num_nodes)
        assert set(g) == set(want), (set(g), set(want))
        assert_same({k: g[k] for k in want}, want, f"{name}[{i}]")


def test_pt_sparse_tensor_is_one_clear_line(tmp_path: Path, store: Path) -> None:
    torch.save({"a": torch.eye(3).to_sparse()}, tmp_path / "s.pt")
    with pytest.raises(InvalidDataError, match=r"s\.pt: field 'a' is a torch\.sparse_coo tensor"):
        ingest(tmp_path / "s.pt", store, "sp", progress=False)


def test_pt_absurd_num_nodes_is_one_clear_line(tmp_path: Path, store: Path) -> None:
    torch.save(
        pyg_data.Data(edge_index=torch.tensor([[0], [1]]), num_nodes=2**40), tmp_path / "g.pt"
    )
    with pytest.raises(InvalidDataError, match=r"g\.pt: num_nodes is 1099511627776"):
        ingest(tmp_path / "g.pt", store, "nn", progress=False)


def test_image_folder_with_train_and_test_is_two_datasets(tmp_path: Path, store: Path) -> None:
    """``train/CLASS/x.jpg`` + ``test/CLASS/x.jpg`` was one dataset whose classes were
    "test" and "train"; now each split is an image folder of its own classes."""
    for split, n in (("train", 3), ("test", 2)):
        for cls in ("cat", "dog"):
            (tmp_path / "src" / split / cls).mkdir(parents=True)
            for i in range(n):
                (tmp_path / "src" / split / cls / f"{i}.jpg").write_bytes(b"\xff\xd8" + bytes([i]))
    report = ingest_all(tmp_path / "src", store, "pics", progress=False)
    got = {s.manifest.name: s.manifest for s in report.summaries}
    assert {k: m.num_samples for k, m in got.items()} == {"pics-test": 4, "pics-train": 6}
    assert all(json.loads(m.source["classes"]) == ["cat", "dog"] for m in got.values())


def test_parquet_nulls_in_list_columns_keep_their_dtype_and_rows(
    tmp_path: Path, store: Path
) -> None:
    """A missing row of a variable list column is a masked row (ingest used to crash), and a
    fixed-size int32 column with missing rows stays int32 (it used to become float64)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardserve.server.store.catalog import Store

    table = pa.table(
        {
            "v": pa.array([[1, 2], None, [3]], pa.list_(pa.int64())),
            "f": pa.array([[1, 2, 3], None, [4, 5, 6]], pa.list_(pa.int32(), 3)),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    ingest(tmp_path / "t.parquet", store, "t", progress=False)
    ds = Store(store).open("t")
    specs = {f.name: f for f in ds.manifest.fields}
    assert (specs["f"].dtype, specs["f"].shape, specs["f"].nullable) == ("int32", (3,), True)
    parts = ds.take([0, 1, 2])
    assert parts["f"].dtype == np.int32 and parts["f"][[0, 2]].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert parts["f.mask"].tolist() == parts["v.mask"].tolist() == [True, False, True]
    assert parts["v"].tolist() == [1, 2, 3] and parts["v.offsets"].tolist() == [0, 2, 2, 3]


def test_parquet_hole_inside_a_fixed_value_is_refused(tmp_path: Path, store: Path) -> None:
    """A missing element inside a row that has a value is refused, naming the file, the column
    and the row: never stored as a number."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"g": pa.array([[1, None, 3], [4, 5, 6]], pa.list_(pa.int32(), 3))})
    pq.write_table(table, tmp_path / "holes.parquet")
    with pytest.raises(InvalidDataError, match=r"holes\.parquet.*column 'g'.*inside row 0"):
        ingest(tmp_path / "holes.parquet", store, "holes", progress=False)
    assert not (store / "holes").exists()


def test_files_of_no_format_beside_pt_files_are_named_not_dropped_silently(
    tmp_path: Path, store: Path
) -> None:
    """A ``torch.save`` file named ``.pkl`` or with no suffix, and a note, in a folder of
    ``.pt`` files: the ``.pt`` files are the dataset, and the summary names every file it did
    not read (hidden files aside), as the manifest counts them."""
    src = tmp_path / "src"
    (src / "more").mkdir(parents=True)
    for i in range(3):
        torch.save({"x": torch.full((2,), float(i))}, src / f"{i}.pt")
    torch.save({"x": torch.ones(2)}, src / "extra.pkl")
    torch.save({"x": torch.ones(2)}, src / "more" / "noext")
    (src / "notes.txt").write_text("labels are in x")
    (src / ".DS_Store").write_bytes(b"\0")
    summary = ingest(src, store, "pts", progress=False)
    assert summary.manifest.num_samples == 3
    assert summary.left_out == ("extra.pkl", "more/noext", "notes.txt")
    assert "left out 3 file(s) that are not pt files: extra.pkl, more/noext, notes.txt" in (
        summary.line()
    )
    assert summary.manifest.source["left_out"] == "3"
    # A folder with nothing else in it says nothing of the kind.
    for p in (src / "extra.pkl", src / "more" / "noext", src / "notes.txt"):
        p.unlink()
    clean = ingest(src, store, "pts2", progress=False)
    assert clean.left_out == () and "left out" not in clean.line()
