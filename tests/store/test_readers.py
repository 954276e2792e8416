"""Ingest readers declare their own suffixes; the registry finds a source's format from them
and reports a missing source once, by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardserve.proto.errors import InvalidDataError
from shardserve.server.store.ingest.registry import FORMATS, READERS, detect, open_ingest_source


def test_each_suffix_names_one_reader_and_every_reader_is_a_format() -> None:
    """No suffix is claimed by two readers; --format offers every reader, after "auto"."""
    suffixes = [s for r in READERS for s in r.suffixes]
    assert len(suffixes) == len(set(suffixes)) and all(s == s.lower() for s in suffixes)
    assert ("auto", *(r.name for r in READERS)) == FORMATS
    assert {r.name for r in READERS if r.claims is not None} == {"hf", "lmdb", "mds", "litdata"}


@pytest.mark.parametrize("reader", READERS, ids=lambda r: r.name)
def test_a_file_is_detected_by_its_readers_suffixes(tmp_path: Path, reader: object) -> None:
    """A file with any of a reader's suffixes (any case) is that reader's format."""
    for sfx in reader.suffixes:  # type: ignore[attr-defined]
        f = tmp_path / f"x{sfx.upper()}"
        f.write_bytes(b"")
        assert detect(f) == reader.name  # type: ignore[attr-defined]


def test_folder_formats_are_claimed_by_their_marker_files(tmp_path: Path) -> None:
    """A save_to_disk folder, an LMDB environment, an MDS folder and a LitData folder are known
    by their files, not suffixes (the last two both by an index.json, told apart by what it
    lists)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "state.json").write_text("{}")
    (hf / "dataset_info.json").write_text("{}")
    (hf / "data-00000-of-00001.arrow").write_bytes(b"")
    assert detect(hf) == "hf"
    env = tmp_path / "env"
    env.mkdir()
    (env / "data.mdb").write_bytes(b"")
    assert detect(env) == "lmdb" and detect(env / "data.mdb") == "lmdb"
    lit = tmp_path / "lit"
    lit.mkdir()
    (lit / "index.json").write_text('{"chunks": [], "config": {}}')
    (lit / "chunk-0-0.bin").write_bytes(b"")
    assert detect(lit) == "litdata"
    mds = tmp_path / "mds"
    mds.mkdir()
    (mds / "index.json").write_text('{"shards": [{"format": "mds"}], "version": 2}')
    (mds / "shard.00000.mds").write_bytes(b"")
    assert detect(mds) == "mds"


def test_missing_mixed_and_unknown_sources_are_refused_by_name(tmp_path: Path) -> None:
    """A missing source, a folder of two formats and one of no known files each get an error
    that names the source and what to do."""
    with pytest.raises(InvalidDataError, match=r"source .*nowhere does not exist"):
        open_ingest_source(tmp_path / "nowhere")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.pt").write_bytes(b"")
    (mixed / "b.parquet").write_bytes(b"")
    with pytest.raises(InvalidDataError, match=r"several formats \(parquet, pt\).*--format"):
        open_ingest_source(mixed)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("hi")
    with pytest.raises(InvalidDataError, match=r"holds no files ingest can read \(\.pt"):
        open_ingest_source(other)
    with pytest.raises(InvalidDataError, match=r"unknown format 'csv'; choose one of auto, pt"):
        open_ingest_source(other, "csv")
