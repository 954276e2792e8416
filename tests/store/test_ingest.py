"""Ingest from .pt folders, .npz/.npy files and Parquet/Arrow, and refusal of bad sources."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardserve.proto.errors import InvalidDataError
from shardserve.server.store.catalog import Store
from shardserve.server.store.ingest.run import ingest


@dataclass
class Opaque:
    """A custom class: torch.save pickles it, weights_only loading must refuse it."""

    value: int


def _write_pt_folder(folder: Path, n: int) -> None:
    for i in range(n):
        sub = folder / f"part{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        sample = {
            "image": torch.full((3, 4, 4), i, dtype=torch.uint8),
            "label": i % 10,
            "atoms": torch.arange(i % 5 + 1, dtype=torch.float32),
        }
        torch.save(sample, sub / f"{i:04d}.pt")


def test_pt_folder_recursive_sorted(tmp_path: Path, store_root: Path) -> None:
    """Nested .pt files are ingested in sorted path order with a declared variable field."""
    _write_pt_folder(tmp_path / "src", 12)
    s = ingest(tmp_path / "src", store_root, "pts", variable=["atoms"], progress=False, threads=2)
    assert s.manifest.num_samples == 12 and s.files == 12
    assert s.manifest.field("atoms").shape == (-1,)
    order = sorted(
        (tmp_path / "src").rglob("*.pt"), key=lambda p: p.relative_to(tmp_path / "src").as_posix()
    )
    want = [int(p.stem) for p in order]
    parts = Store(store_root).open("pts").take(np.arange(12))
    assert parts["image"][:, 0, 0, 0].tolist() == want
    assert parts["label"].tolist() == [i % 10 for i in want]
    assert np.diff(parts["atoms.offsets"]).tolist() == [i % 5 + 1 for i in want]


def test_pt_varying_dimension_is_found_without_the_flag(tmp_path: Path, store_root: Path) -> None:
    """A dimension that varies between samples makes the field variable by itself;
    the summary says so."""
    _write_pt_folder(tmp_path / "src", 4)
    s = ingest(tmp_path / "src", store_root, "pts", progress=False)
    assert s.manifest.field("atoms").shape == (-1,)
    assert "variable: atoms [-1]" in s.line()


def test_pt_changing_rank_names_file_and_field(tmp_path: Path, store_root: Path) -> None:
    """A field whose number of dimensions changes is refused naming the file and field;
    nothing published."""
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"atoms": torch.zeros(3)}, src / "a.pt")
    torch.save({"atoms": torch.zeros(3, 2)}, src / "b.pt")
    with pytest.raises(InvalidDataError, match=r"b\.pt: field 'atoms' has shape \(3, 2\)"):
        ingest(src, store_root, "pts", progress=False)
    assert Store(store_root).list() == [] and list(store_root.iterdir()) == []


def test_pt_with_pickled_object_is_refused(tmp_path: Path, store_root: Path) -> None:
    """A .pt holding a custom class instance is refused by name, explaining why; nothing runs."""
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"x": torch.zeros(2)}, src / "a.pt")
    torch.save({"x": torch.zeros(2), "meta": Opaque(3)}, src / "b.pt")
    with pytest.raises(
        InvalidDataError, match=r"b\.pt: refused: it holds pickled Python objects"
    ) as err:
        ingest(src, store_root, "bad", progress=False)
    assert "arbitrary code" in str(err.value)
    assert Store(store_root).list() == []


def test_pt_empty_file_is_named_with_a_reason(tmp_path: Path, store_root: Path) -> None:
    """An empty ``.pt`` (a save cut short) is refused naming the file and why, where torch's
    own error is an ``EOFError`` with no text; nothing is published."""
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"x": torch.zeros(2)}, src / "a.pt")
    (src / "b.pt").touch()
    with pytest.raises(InvalidDataError, match=r"b\.pt: torch\.load failed: the file ends before"):
        ingest(src, store_root, "cut", progress=False)
    assert Store(store_root).list() == []


def test_npz_and_npy_sources(tmp_path: Path, store_root: Path) -> None:
    """.npz files are sample blocks; a folder of .npy files is one field per file."""
    npz = tmp_path / "npz"
    npz.mkdir()
    np.savez(npz / "a.npz", img=np.arange(40, dtype=np.float32).reshape(10, 4), y=np.arange(10))
    np.savez(
        npz / "b.npz", img=np.arange(40, 60, dtype=np.float32).reshape(5, 4), y=np.arange(10, 15)
    )
    assert ingest(npz, store_root, "npz", progress=False).manifest.num_samples == 15
    y = Store(store_root).open("npz").take(np.arange(15))["y"]
    assert y.tolist() == list(range(15))
    npy = tmp_path / "npy"
    npy.mkdir()
    np.save(npy / "feat.npy", np.ones((7, 2, 2), np.float16))
    np.save(npy / "target.npy", np.arange(7, dtype=np.int32))
    m = ingest(npy, store_root, "npy", progress=False).manifest
    assert {f.name: f.shape for f in m.fields} == {"feat": (2, 2), "target": ()}


def test_npz_arrays_of_different_lengths_are_refused(tmp_path: Path, store_root: Path) -> None:
    """Arrays without a shared leading dimension are refused, naming the file."""
    np.savez(tmp_path / "x.npz", a=np.zeros(3), b=np.zeros(4))
    with pytest.raises(InvalidDataError, match=r"x\.npz.*leading sample dimension"):
        ingest(tmp_path / "x.npz", store_root, "x", progress=False)


def _table(start: int, n: int) -> pa.Table:
    ids = np.arange(start, start + n)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "vec": pa.FixedSizeListArray.from_arrays(
                pa.array(np.repeat(ids, 3).astype(np.float32)), 3
            ),
            "tokens": pa.array([list(range(i % 4)) for i in ids], pa.list_(pa.int32())),
            "text": pa.array([f"s{i}" for i in ids]),
            "blob": pa.array([bytes([i % 256]) * (i % 3) for i in ids], pa.binary()),
        }
    )


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_parquet_and_arrow_folders(tmp_path: Path, store_root: Path, fmt: str) -> None:
    """Numeric -> scalar, fixed-size list -> tensor, list -> variable, string/binary -> binary."""
    src = tmp_path / "src"
    src.mkdir()
    for k in range(2):
        if fmt == "parquet":
            pq.write_table(_table(k * 20, 20), src / f"{k}.parquet")
        else:
            with pa.ipc.new_file(src / f"{k}.arrow", _table(k * 20, 20).schema) as w:
                w.write_table(_table(k * 20, 20))
    m = ingest(src, store_root, "t", progress=False).manifest
    assert {f.name: (f.kind, f.shape) for f in m.fields} == {
        "id": ("scalar", ()),
        "vec": ("tensor", (3,)),
        "tokens": ("variable", (-1,)),
        "text": ("binary", ()),
        "blob": ("binary", ()),
    }
    parts = Store(store_root).open("t").take([25, 3])
    assert parts["id"].tolist() == [25, 3] and parts["vec"][:, 0].tolist() == [25.0, 3.0]
    assert parts["tokens"].tolist() == [0, 0, 1, 2] and parts["tokens.offsets"].tolist() == [
        0,
        1,
        4,
    ]
    assert parts["text"].tobytes() == b"s25s3"


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: p.joinpath("empty").mkdir() or p / "empty", "no files ingest can read"),
    ],
)
def test_empty_or_missing_source(
    tmp_path: Path, store_root: Path, make: object, needle: str
) -> None:
    """A missing or empty source is refused and nothing is published."""
    src = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(InvalidDataError, match=needle):
        ingest(src, store_root, "x", progress=False)
    assert list(store_root.iterdir()) == []


def test_mixed_formats_need_format_flag(tmp_path: Path, store_root: Path) -> None:
    """A folder with .pt and .npz files asks for --format; with it, the chosen kind is read."""
    torch.save({"v": torch.zeros(2)}, tmp_path / "a.pt")
    np.savez(tmp_path / "b.npz", v=np.zeros((3, 2)))
    with pytest.raises(InvalidDataError, match="choose one with --format"):
        ingest(tmp_path, store_root, "x", progress=False)
    assert ingest(tmp_path, store_root, "x", fmt="npz", progress=False).manifest.num_samples == 3
