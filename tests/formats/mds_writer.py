"""Writes MDS datasets with MosaicML Streaming's own ``MDSWriter`` and records what its
``StreamingDataset`` yields for them, for ``test_mds.py``.

Run with the Python of the environment that has ``mosaicml-streaming`` (``.venv-mds``: its
pins conflict with the dev extra), as ``python mds_writer.py OUT``. It writes
``OUT/NAME/`` datasets and ``OUT/want.npz`` (no pickles: arrays only) with
``OUT/kinds.json`` saying how each column's values are recorded.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from decimal import Decimal
from pathlib import Path

import numpy as np
from PIL import Image

# streaming's top-level package imports its vision module, which needs torchvision, and no
# torchvision wheel imports beside the CPU build of torch the project uses: the package is
# entered without its __init__, and streaming.base (the writer and the dataset) is imported
# as itself.
_spec = importlib.util.find_spec("streaming")
assert _spec is not None and _spec.submodule_search_locations is not None
_pkg = types.ModuleType("streaming")
_pkg.__path__ = list(_spec.submodule_search_locations)
sys.modules["streaming"] = _pkg

from streaming.base import MDSWriter, StreamingDataset  # noqa: E402

#: column -> (MDS encoding, how want.npz records what StreamingDataset gives).
COLUMNS = {
    "b": ("bytes", "bytes"),
    "d": ("str_decimal", "str"),
    "f": ("float32", "array"),
    "g": ("float64", "array"),
    "i": ("str_int", "array"),
    "j": ("json", "json"),
    "p": ("pil", "array"),
    "png": ("png", "image"),
    "s": ("str", "str"),
    "v": ("ndarray", "array"),
    "w": ("ndarray:uint16", "array"),
    "x": ("ndarray:float32:2,3", "array"),
    "y": ("int", "array"),
    "z": ("uint8", "array"),
}


def sample(i: int) -> dict[str, object]:
    rng = np.random.default_rng(i)
    img = Image.fromarray(rng.integers(0, 255, (4 + i % 3, 5, 3), dtype=np.uint8))
    return {
        "b": bytes(rng.integers(0, 255, i % 7, dtype=np.uint8)),
        "d": Decimal(f"{i}.{i % 10}0"),
        "f": np.float32(i / 3),
        "g": np.float64(-i / 7),
        "i": i * 7 - 50,
        "j": {"id": i, "score": [1.5, float(i)], "tag": f"t{i}"},
        "p": img,
        "png": img.convert("L"),
        "s": f"sample {i} é",
        "v": rng.standard_normal((1 + i % 3, 2 + i % 2)).astype(np.float64),
        "w": np.arange(1 + i % 5, dtype=np.uint16),
        "x": rng.standard_normal((2, 3)).astype(np.float32),
        "y": 2**40 + i,
        "z": np.uint8(i % 256),
    }


def record(value: object, kind: str) -> np.ndarray:
    if kind == "bytes":
        assert isinstance(value, bytes)
        return np.frombuffer(value, np.uint8)
    if kind == "str":
        return np.array(str(value))
    if kind == "json":
        return np.array(json.dumps(value))
    if kind == "image":
        assert isinstance(value, Image.Image)
        return np.asarray(value)
    if isinstance(value, Image.Image):
        return np.asarray(value)
    return np.asarray(value)


def main(out: Path) -> None:
    columns = {k: enc for k, (enc, _) in COLUMNS.items()}
    made = {
        "zstd": dict(compression="zstd:3", hashes=["sha1", "xxh64"], n=40),
        "plain": dict(compression=None, hashes=["sha1"], n=25),
        "gz": dict(compression="gz", hashes=[], n=12),
        "snappy": dict(compression="snappy", hashes=["xxh3_64"], n=9),
    }
    want: dict[str, np.ndarray] = {}
    for name, opts in made.items():
        with MDSWriter(
            out=str(out / name),
            columns=columns,
            compression=opts["compression"],
            hashes=opts["hashes"],
            size_limit=1 << 12,
        ) as w:
            for i in range(int(opts["n"])):  # type: ignore[call-overload]
                w.write(sample(i))
        ds = StreamingDataset(local=str(out / name), shuffle=False, batch_size=1)
        for i in range(ds.num_samples):
            got = ds[i]
            for col, (_, kind) in COLUMNS.items():
                want[f"{name}/{i}/{col}"] = record(got[col], kind)
    # A pickled column, and splits as a Streaming user lays them out (one folder each).
    with MDSWriter(out=str(out / "pickled"), columns={"x": "int", "obj": "pkl"}) as w:
        w.write({"x": 1, "obj": {"a": 1}})
    for split, n in (("train", 6), ("val", 3)):
        with MDSWriter(out=str(out / "splits" / split), columns={"x": "int"}) as w:
            for i in range(n):
                w.write({"x": i})
    np.savez(out / "want.npz", **want)
    (out / "kinds.json").write_text(json.dumps({k: kind for k, (_, kind) in COLUMNS.items()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
