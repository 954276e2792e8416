"""Corrupt data: truncated and deleted shards fail the job by name, never the server.

The flipped-byte case under the default ``--verify lazy`` is in tests/server/test_lifecycle.py;
here: truncated and deleted shards under lazy and full verification, a flipped byte refused at
first open under ``--verify full``, and a shard truncated underneath a running server.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pytest

from shardserve.client import DatasetCorruptError, Loader, ShardserveError
from tests.support.data import make_cifar_like, sample_id_of
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

N = 300
DEADLINE_S = 10.0
REASONS = {"truncate": "truncated", "delete": "missing", "flip": "checksum"}


def _corrupt(shard: Path, how: str) -> None:
    if how == "truncate":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
    elif how == "delete":
        shard.unlink()
    else:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A private store: ``cifar`` in several shards (the second one gets corrupted) and ``good``."""
    root = tmp_path / "store"
    make_cifar_like(root, "cifar", n=N, shard_bytes=256 << 10)
    make_cifar_like(root, "good", n=100, seed=3)
    assert len(list((root / "cifar").rglob("*.arrow"))) >= 3
    return root


def _ids(batch: dict) -> np.ndarray:
    return sample_id_of({"image": batch["image"].numpy(), "label": batch["label"].numpy()})


@pytest.mark.parametrize(
    ("how", "verify"), [("truncate", "lazy"), ("delete", "lazy"), ("truncate", "full")]
)
def test_a_cut_or_deleted_shard_refuses_the_job_when_it_is_made(
    store: Path, tmp_path: Path, how: str, verify: str
) -> None:
    """A truncated or deleted shard is found when the job is made (a stat per shard): the
    Loader raises DatasetCorruptError naming the shard and why, no job is left, and another
    dataset keeps serving."""
    victim = sorted((store / "cifar").rglob("*.arrow"))[1]
    _corrupt(victim, how)
    with run_server(store, "--verify", verify, "--state-dir", str(tmp_path / "state")) as srv:
        with pytest.raises(DatasetCorruptError) as err:
            Loader(srv.http_url, "cifar", batch_size=50, shuffle=False, timeout=scaled(DEADLINE_S))
        assert victim.name in str(err.value) and REASONS[how] in str(err.value)
        assert httpx.get(f"{srv.http_url}/v1/jobs", timeout=scaled(10)).json() == []
        _good_dataset_streams(srv)


def _loop_a_shard(shard: Path) -> None:
    shard.unlink()
    shard.symlink_to(shard.name)  # a link to itself: every stat is ELOOP


def _shards_folder_a_file(shard: Path) -> None:
    folder = shard.parent
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    folder.write_bytes(b"not a folder")  # every stat under it is ENOTDIR


def _shard_a_folder(shard: Path) -> None:
    shard.unlink()
    shard.mkdir()


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (_loop_a_shard, "symbolic links (ELOOP)"),
        (_shards_folder_a_file, "Not a directory (ENOTDIR)"),
        (_shard_a_folder, "not a regular file"),
    ],
    ids=["symlink-loop", "shards-folder-a-file", "shard-a-folder"],
)
def test_a_shard_that_cannot_be_stat_ed_refuses_the_job_as_corrupt(
    store: Path, tmp_path: Path, damage: Callable[[Path], None], why: str
) -> None:
    """A shard that is a symlink loop or a folder, or a ``shards/`` folder that is a file: the
    stat at job creation fails (an OSError that is not 'missing') or finds no regular file, and
    that is the same 409 / DatasetCorruptError naming the shard and why, never a 500; another
    dataset keeps serving."""
    victim = sorted((store / "cifar").rglob("*.arrow"))[1]
    damage(victim)
    with run_server(store, "--state-dir", str(tmp_path / "state")) as srv:
        spec = {"dataset": "cifar", "batch_size": 50}
        r = httpx.post(f"{srv.http_url}/v1/jobs", json=spec, timeout=scaled(10))
        assert r.status_code == 409, (r.status_code, r.text)
        assert "shards/" in r.text and why in r.text, r.text
        with pytest.raises(DatasetCorruptError) as err:
            Loader(srv.http_url, "cifar", batch_size=50, shuffle=False, timeout=DEADLINE_S)
        assert "shards/" in str(err.value) and why in str(err.value), err.value
        assert httpx.get(f"{srv.http_url}/v1/jobs", timeout=scaled(10)).json() == []
        _good_dataset_streams(srv)
        assert "Traceback" not in srv.log_tail(100_000), srv.log_tail()


def test_a_flipped_byte_under_verify_full_fails_the_job_before_any_batch(
    store: Path, tmp_path: Path
) -> None:
    """A flipped byte under --verify full makes the Loader raise DatasetCorruptError within its
    deadline, fails the job naming the shard and why before any batch, and another dataset keeps
    serving."""
    # Same size: the stat at job creation passes. A shard deleted once its dataset is mapped is
    # still read through the mapping: nothing to fail.
    victim = sorted((store / "cifar").rglob("*.arrow"))[1]
    _corrupt(victim, "flip")
    with run_server(store, "--verify", "full", "--state-dir", str(tmp_path / "state")) as srv:
        loader = Loader(
            srv.http_url,
            "cifar",
            batch_size=50,
            shuffle=False,
            prefetch=2,
            timeout=scaled(DEADLINE_S),
        )
        delivered: list[np.ndarray] = []
        t0 = time.monotonic()
        with loader, pytest.raises(DatasetCorruptError) as err:
            for b in loader:
                delivered.append(_ids(b))
        assert time.monotonic() - t0 < scaled(DEADLINE_S)
        assert victim.name in str(err.value) and "checksum" in str(err.value)
        st = httpx.get(f"{srv.http_url}/v1/jobs/{loader.job_id}", timeout=scaled(10)).json()
        assert st["state"] == "failed"
        assert victim.name in st["error"] and "checksum" in st["error"], st["error"]
        assert not delivered, "--verify full must refuse at first open, before any batch"
        _good_dataset_streams(srv)


def _good_dataset_streams(srv: ServerProc) -> None:
    """The server is alive and another dataset streams a whole epoch."""
    with Loader(
        srv.http_url, "good", batch_size=25, prefetch=2, timeout=scaled(DEADLINE_S)
    ) as good:
        ids = np.concatenate([_ids(b) for b in good])
    assert np.array_equal(np.sort(ids), np.arange(100))
    assert srv.proc.poll() is None


def test_shard_truncated_while_served_fails_the_job_not_the_server(
    store: Path, tmp_path: Path
) -> None:
    """A shard truncated in place after the server verified and mapped it fails the job with DatasetCorruptError; the server stays up."""
    with run_server(store, "--state-dir", str(tmp_path / "state")) as srv:
        with Loader(
            srv.http_url, "cifar", batch_size=50, shuffle=False, prefetch=1, timeout=4.0
        ) as ld:
            assert len(np.concatenate([_ids(b) for b in ld])) == N  # every shard checked and mapped
            victim = sorted((store / "cifar").rglob("*.arrow"))[1]
            with open(victim, "r+b") as f:
                f.truncate(victim.stat().st_size // 2)
            raised: BaseException | None = None
            try:
                for _ in ld:
                    pass
            except ShardserveError as e:
                raised = e
            code = srv.proc.poll()
        assert code is None, (
            f"server died with exit code {code} (-7 is SIGBUS); client saw {raised!r}"
        )
        assert isinstance(raised, DatasetCorruptError), repr(raised)


def _image_byte(shard: Path, row: int) -> int:
    """The file offset of a byte inside sample ``row``'s image in ``shard``."""
    mm = pa.memory_map(str(shard))
    whole = mm.read_buffer(mm.size())
    mm.seek(0)
    reader = pa.ipc.open_file(mm)
    for i in range(reader.num_record_batches):
        batch = reader.get_batch(i)
        if row < batch.num_rows:
            values = batch.column("image").flatten()
            return int(values.buffers()[1].address - whole.address) + row * 3072 + 100
        row -= batch.num_rows
    raise AssertionError(f"no row {row} in {shard}")


@pytest.mark.parametrize("manifest", ["blocks", "whole-file"])
def test_a_flipped_byte_fails_the_batch_that_reads_its_block(tmp_path: Path, manifest: str) -> None:
    """A flipped byte inside sample 2000 lets every batch before the damaged block arrive exact in
    order, then fails the job naming the shard and the block."""
    # The first shard is 8 MiB in 1 MiB blocks. Without block checksums (a manifest written before
    # they were kept) the shard's whole file is checked before its first read, so nothing of it
    # arrives.
    root = tmp_path / "store"
    m = make_cifar_like(root, "cifar", n=4000, shard_bytes=8 << 20)
    folder = root / "cifar"
    assert m.shards[0].rows > 2000 and m.shards[0].block_bytes == 1 << 20
    if manifest == "whole-file":
        doc = json.loads((folder / "manifest.json").read_text())
        for shard in doc["shards"]:
            del shard["block_bytes"], shard["blocks"]
        (folder / "manifest.json").write_text(json.dumps(doc))
    victim = folder / m.shards[0].path
    at = _image_byte(victim, 2000)
    data = bytearray(victim.read_bytes())
    data[at] ^= 0xFF
    victim.write_bytes(bytes(data))
    with run_server(root, "--state-dir", str(tmp_path / "state")) as srv:
        loader = Loader(
            srv.http_url,
            "cifar",
            batch_size=50,
            shuffle=False,
            prefetch=2,
            timeout=scaled(DEADLINE_S),
        )
        delivered: list[np.ndarray] = []
        with loader, pytest.raises(DatasetCorruptError) as err:
            for b in loader:
                delivered.append(_ids(b))
    got = np.concatenate(delivered) if delivered else np.array([], dtype=np.int64)
    assert np.array_equal(got, np.arange(len(got)))  # exact, in plan order
    assert victim.name in str(err.value) and "checksum" in str(err.value)
    if manifest == "whole-file":
        assert len(got) == 0
    else:
        block = at // (1 << 20)
        assert f"block {block}" in str(err.value), err.value
        # Everything before the damaged block arrived: a block holds about 341 samples.
        assert 2000 - 341 - 50 <= len(got) <= 2000, len(got)
