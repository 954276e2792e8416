"""Hugging Face datasets whole: every feature type, written by ``datasets`` with
``save_to_disk`` and with ``to_parquet``, read back through a real server and Loader equal to
what ``datasets`` gives for each sample; strings as ``str``, ClassLabel names exposed, an
``Image()`` column decoded by ``decode_image`` directly."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from shardserve.client import Loader
from shardserve.proto.errors import InvalidDataError
from shardserve.server.store.ingest.run import ingest
from tests.formats.support import assert_same, read_all
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

D = pytest.importorskip("datasets")
PIL = pytest.importorskip("PIL.Image")

N = 9


def _png(i: int) -> bytes:
    b = io.BytesIO()
    PIL.new("RGB", (4 + i, 3), (i * 20, 7, 0)).save(b, format="PNG")
    return b.getvalue()


def _dataset() -> Any:
    feats = D.Features(
        {
            "a2": D.Array2D((2, 3), "float32"),
            "a3": D.Array3D((2, 2, 2), "int32"),
            "a4": D.Array4D((1, 2, 1, 2), "uint8"),
            "a5": D.Array5D((1, 1, 2, 1, 2), "float64"),
            "seqseq": D.Sequence(D.Sequence(D.Value("float32"))),
            "strs": D.Sequence(D.Value("string")),
            "sdict": D.Sequence({"p": D.Value("int64"), "q": D.Value("float32")}),
            "ldict": [{"p": D.Value("int64")}],
            "img": D.Image(),
            "aud": {"bytes": D.Value("binary"), "path": D.Value("string")},
            "lab": D.ClassLabel(names=["cat", "dog", "eel"]),
            "txt": D.Value("string"),
            "nest": {"u": {"v": D.Value("int16")}},
        }
    )
    rows = {
        "a2": [np.full((2, 3), i, np.float32) for i in range(N)],
        "a3": [np.arange(8, dtype=np.int32).reshape(2, 2, 2) + i for i in range(N)],
        "a4": [np.full((1, 2, 1, 2), i, np.uint8) for i in range(N)],
        "a5": [np.full((1, 1, 2, 1, 2), i / 2, np.float64) for i in range(N)],
        "seqseq": [[[float(i), float(j)] for j in range(i % 3 + 1)] for i in range(N)],
        "strs": [[f"s{i}é", ""][: i % 3] for i in range(N)],
        "sdict": [{"p": [i] * (i % 2 + 1), "q": [0.5 * i] * (i % 2 + 1)} for i in range(N)],
        "ldict": [[{"p": i}, {"p": -i}][: i % 2 + 1] for i in range(N)],
        "img": [PIL.open(io.BytesIO(_png(i))) for i in range(N)],
        "aud": [{"bytes": b"RIFF" + bytes([i]), "path": None} for i in range(N)],
        "lab": [i % 3 for i in range(N)],
        "txt": [f"héllo {i}" if i % 4 else None for i in range(N)],
        "nest": [{"u": {"v": i}} for i in range(N)],
    }
    ds = D.Dataset.from_dict(rows, features=feats)
    # Audio() encoding needs torchcodec; casting the stored {bytes, path} struct does not.
    return ds.cast_column("aud", D.Audio(decode=False))


def _want(ds: Any) -> list[dict[str, Any]]:
    """What each sample should read back as, from what datasets itself gives."""
    raw = ds.cast_column("img", D.Image(decode=False))
    out = []
    for i in range(len(ds)):
        r = raw[i]
        out.append(
            {
                "a2": torch.tensor(np.array(r["a2"], np.float32)),
                "a3": torch.tensor(np.array(r["a3"], np.int32)),
                "a4": torch.tensor(np.array(r["a4"], np.uint8)),
                "a5": torch.tensor(np.array(r["a5"], np.float64)),
                "seqseq": torch.tensor(np.array(r["seqseq"], np.float32)),
                "strs": list(r["strs"]),
                "sdict": {
                    "p": torch.tensor(r["sdict"]["p"], dtype=torch.int64),
                    "q": torch.tensor(r["sdict"]["q"], dtype=torch.float32),
                },
                # A list of dicts comes back as a dict of lists (a tensor per member).
                "ldict": {"p": torch.tensor([d["p"] for d in r["ldict"]], dtype=torch.int64)},
                "img": r["img"]["bytes"],
                "aud": r["aud"]["bytes"],
                "lab": torch.tensor(r["lab"]),
                "txt": r["txt"],
                "nest": {"u": {"v": torch.tensor(r["nest"]["u"]["v"], dtype=torch.int16)}},
            }
        )
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    src = tmp_path_factory.mktemp("hf")
    store = tmp_path_factory.mktemp("store")
    ds = _dataset()
    ds.save_to_disk(str(src / "disk"))
    (src / "pq").mkdir()
    ds.to_parquet(str(src / "pq" / "all.parquet"))
    ds.select_columns(["img", "lab"]).to_parquet(str(src / "imgs.parquet"))
    summaries = {
        "disk": ingest(src / "disk", store, "disk", progress=False, shard_bytes=600),
        "pq": ingest(src / "pq", store, "pq", progress=False, shard_bytes=600),
        "imgs": ingest(src / "imgs.parquet", store, "imgs", progress=False),
    }
    return {"store": store, "want": _want(ds), "summaries": summaries}


@pytest.fixture(scope="module")
def server(built: dict[str, Any]) -> Iterator[ServerProc]:
    with run_server(built["store"]) as srv:
        yield srv


@pytest.mark.parametrize("name", ["disk", "pq"])
def test_every_feature_reads_back_as_datasets_gives_it(
    built: dict[str, Any], server: ServerProc, name: str
) -> None:
    got = read_all(server.http_url, name, batch_size=4)
    want = built["want"]
    assert len(got) == len(want) == N
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert isinstance(g["txt"], (str, type(None))) and isinstance(g["strs"], list)
        assert_same(g, w, f"{name}[{i}]")


@pytest.mark.parametrize("name", ["disk", "pq"])
def test_class_label_names_are_exposed(
    built: dict[str, Any], server: ServerProc, name: str
) -> None:
    info = httpx.get(f"{server.http_url}/v1/datasets/{name}", timeout=scaled(10)).json()
    assert info["classes"] == ["cat", "dog", "eel"]
    assert info["label_names"] == {"lab": ["cat", "dog", "eel"]}
    text = {f["name"]: f.get("encoding") for f in info["fields"]}
    assert text["txt"] == "utf-8" and text["strs"] == "utf-8-list" and text["img"] is None


def test_image_column_feeds_decode_image(built: dict[str, Any], server: ServerProc) -> None:
    chain = [{"name": "decode_image", "params": {"field": "img"}}]
    with Loader(
        server.http_url, "imgs", batch_size=1, shuffle=False, timeout=scaled(30), transforms=chain
    ) as ld:
        for i, b in enumerate(ld):
            img = b["img"].unbind()[0] if hasattr(b["img"], "unbind") else b["img"][0]
            want = np.asarray(PIL.open(io.BytesIO(_png(i))).convert("RGB"))
            assert np.array_equal(img.numpy(), want), i


def test_ragged_nested_sequence_is_refused_naming_the_row(tmp_path: Path) -> None:
    ds = D.Dataset.from_dict({"s": [[[1.0], [1.0, 2.0]]]})
    ds.save_to_disk(str(tmp_path / "r"))
    with pytest.raises(InvalidDataError, match=r"column 's' row 0 is a ragged list of lists"):
        ingest(tmp_path / "r", tmp_path / "store", "r", progress=False)
