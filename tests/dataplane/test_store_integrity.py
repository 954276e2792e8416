"""Store side: zero-copy mapping, shard identity, distinct shards, safe sweeps."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from shardserve.proto.errors import DatasetCorruptError, InvalidDataError
from shardserve.proto.manifest import FieldSpec
from shardserve.proto.messages import Error
from shardserve.server.runtime.rings import PREFIX, create_ring, remove_stale
from shardserve.server.store import layout
from shardserve.server.store.ingest.run import ingest
from shardserve.server.store.read.dataset import Dataset
from shardserve.server.store.write.writer import ShardWriter
from tests.server.rawclient import Batch, RawStream, zmq_context
from tests.support.data import make_cifar_like
from tests.support.server import make_job, run_server
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]


def _write_floats(root: Path, name: str, n: int, shape: tuple[int, ...]) -> int:
    fields = [FieldSpec(name="z", dtype="float32", shape=shape)]
    block = np.ones((64, *shape), dtype=np.float32)
    with ShardWriter(root, name, fields=fields) as w:
        for start in range(0, n, 64):
            w.add_batch({"z": block[: min(64, n - start)]})
    assert w.manifest is not None
    return w.manifest.total_bytes


def test_opening_a_dataset_does_not_copy_it_into_private_memory(tmp_path: Path) -> None:
    """Opening and reading a 64 MiB dataset raises the process's private (anonymous) memory by far less than the dataset, and opening it touches almost none of its pages: the shards are mapped, not copied or read."""
    nbytes = _write_floats(tmp_path, "big", 256, (64, 1024))  # 256 KiB samples
    script = textwrap.dedent(
        """
        import json, sys
        from pathlib import Path
        from shardserve.server.store.catalog import Store
        def rss(kind):
            for line in open("/proc/self/status"):
                if line.startswith(kind + ":"):
                    return int(line.split()[1]) * 1024
        import pyarrow as pa
        # pyarrow imports its pandas shim (when pandas is installed) at the first to_numpy:
        # a fixed cost, paid here so that only what the dataset adds is measured.
        pa.array([1.0]).to_numpy()
        store = Store(Path(sys.argv[1]))
        before, file_before = rss("RssAnon"), rss("RssFile")
        ds = store.open("big", verify="lazy")
        opened = rss("RssFile")           # opening reads footers, not the shards
        ds.take([0, 100, 255])            # a first batch: lazily verifies the shards it reads
        print(json.dumps({"before": before, "after": rss("RssAnon"),
                          "open_touched": opened - file_before}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    growth = got["after"] - got["before"]
    assert growth < 0.1 * nbytes, f"private memory grew {growth} bytes for a {nbytes}-byte dataset"
    assert got["open_touched"] < 0.1 * nbytes, "opening the dataset read its shards"


def test_shard_truncated_and_regrown_while_served_fails_loudly(tmp_path: Path) -> None:
    """A shard cut and grown back to its size (zeros, same size) while a real server streams it fails the job naming the shard, instead of serving zeros."""
    store = tmp_path / "store"
    m = make_cifar_like(store, "cifar", n=300, shard_bytes=1 << 20)
    shard = store / "cifar" / m.shards[0].path
    with run_server(store) as srv, zmq_context() as ctx:
        job = make_job(srv, batch_size=10, shuffle="none")
        s = RawStream(ctx, srv.tcp_endpoint)
        s.hello(job, credit=1)
        first = s.recv(what="the first batch or Welcome")
        while not isinstance(first, Batch):
            first = s.recv(what="the first batch")
        size = shard.stat().st_size
        time.sleep(0.01)  # let the clock move past the mapped file's mtime
        with open(shard, "r+b") as f:
            f.truncate(0)
            f.truncate(size)
        assert shard.stat().st_size == size
        s.grant(5)
        err = None
        for _ in range(10):
            msg = s.recv(what="an Error for the changed shard")
            if isinstance(msg, Error):
                err = msg
                break
            assert not isinstance(msg, Batch) or msg.parts["image"].any(), "served zeros"
        assert err is not None and "modified while being served" in err.message
        assert str(shard) in err.message
        st = httpx.get(f"{srv.http_url}/v1/jobs/{job}", timeout=scaled(10)).json()
        assert st["state"] == "failed" and "modified" in st["error"]
        s.close()


def test_manifest_listing_a_shard_twice_is_refused(tmp_path: Path) -> None:
    """A manifest naming one shard twice is not served (it would deliver every sample twice): job creation answers 4xx naming the shard."""
    store = tmp_path / "store"
    make_cifar_like(store, "cifar", n=100)
    path = store / "cifar" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["shards"] = [doc["shards"][0], doc["shards"][0]]
    doc["num_samples"] = 2 * doc["shards"][0]["rows"]
    path.write_text(json.dumps(doc))
    with run_server(store) as srv:
        r = httpx.post(
            f"{srv.http_url}/v1/jobs",
            json={"dataset": "cifar", "batch_size": 10},
            timeout=scaled(10),
        )
        assert 400 <= r.status_code < 500, r.text
        assert "distinct" in r.json()["detail"] and doc["shards"][0]["path"] in r.json()["detail"]


def test_two_shard_paths_to_one_file_are_refused(tmp_path: Path) -> None:
    """Two manifest entries that are links to the same file are refused at open, naming both."""
    m = make_cifar_like(tmp_path, "cifar", n=200, shard_bytes=256 << 10)
    assert len(m.shards) >= 2
    folder = tmp_path / "cifar"
    a, b = (folder / s.path for s in m.shards[:2])
    doc = json.loads((folder / "manifest.json").read_text())
    b.unlink()
    os.link(a, b)
    doc["shards"][1] = {**doc["shards"][0], "path": m.shards[1].path}
    doc["num_samples"] = sum(s["rows"] for s in doc["shards"])
    (folder / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(DatasetCorruptError, match="same file"):
        Dataset.mapped(folder, layout.read_manifest(folder))


PUBLISHER = """
import sys
import numpy as np
from pathlib import Path
from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.write.writer import ShardWriter
root, tag, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for i in range(count):
    with ShardWriter(root, f"{tag}{i}", fields=[FieldSpec(name="x", dtype="int64", shape=())]) as w:
        w.add_batch({"x": np.arange(50, dtype=np.int64)})
"""


def test_concurrent_ingests_never_publish_an_empty_dataset(tmp_path: Path) -> None:
    """Two processes publishing in a tight loop (each sweeping stale folders at start) never remove each other's folder: every dataset is published whole."""
    count = 20
    procs = [
        subprocess.Popen([sys.executable, "-c", PUBLISHER, str(tmp_path), tag, str(count)])
        for tag in ("a", "b")
    ]
    for p in procs:
        assert p.wait(timeout=scaled(240)) == 0
    for tag in ("a", "b"):
        for i in range(count):
            with Dataset.mapped(
                tmp_path / f"{tag}{i}", layout.read_manifest(tmp_path / f"{tag}{i}")
            ) as ds:
                assert ds.num_samples == 50
                np.testing.assert_array_equal(ds.take(np.arange(50))["x"], np.arange(50))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_sweep_keeps_a_live_writers_folder_and_removes_a_dead_ones(tmp_path: Path) -> None:
    """A temp folder whose writer holds its lock survives a sweep even without a pid file; one whose writer was SIGKILLed is removed."""
    live = layout.new_temp_dir(tmp_path, "live")
    (live.path / layout.OWNER_FILE).unlink()  # as during a publish
    script = (
        "import sys, time\nfrom pathlib import Path\nfrom shardserve.server.store import layout\n"
        "d = layout.new_temp_dir(Path(sys.argv[1]), 'dead')\nprint(d.path, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    dead = Path(proc.stdout.readline().strip())
    assert layout.clean_stale(tmp_path) == []  # both owners alive
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=scaled(10))
    proc.stdout.close()
    assert layout.clean_stale(tmp_path) == [dead]
    assert live.path.is_dir() and not dead.exists()
    live.release()
    assert layout.clean_stale(tmp_path) == [live.path]


SWEEPER = """
import sys
from pathlib import Path
from shardserve.server.store import layout
root = Path(sys.argv[1])
layout.clean_stale(root)
print("sweeping", flush=True)
while True:
    layout.clean_stale(root)
"""


def test_a_sweep_never_takes_the_lock_of_a_folder_being_created(tmp_path: Path) -> None:
    """Folders created while another process sweeps in a tight loop all survive, locked, because the
    lock file appears under its name already locked."""
    # Before, a sweep could open it between its creation and the writer's flock, take the lock, and
    # remove the new folder (1-10 of these 8,000).
    sweeper = subprocess.Popen(
        [sys.executable, "-c", SWEEPER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    lost: list[str] = []
    try:
        assert sweeper.stdout is not None
        ready, _, _ = select.select([sweeper.stdout], [], [], 60)
        assert ready and sweeper.stdout.readline().strip() == "sweeping", "sweeper did not start"
        for i in range(8000):
            try:
                d = layout.new_temp_dir(tmp_path, f"n{i}")
            except FileNotFoundError as e:  # its folder was removed before its pid file
                lost.append(f"n{i}: {e}")
                continue
            if not (d.path / layout.LOCK_FILE).is_file():
                lost.append(f"n{i}: {d.path} removed")
            d.release()
    finally:
        sweeper.kill()
        sweeper.wait(timeout=scaled(10))
        if sweeper.stdout is not None:
            sweeper.stdout.close()
    assert not lost, f"{len(lost)} new folders removed by a concurrent sweep: {lost[:3]}"


RING_HOLDER = """
import sys, time
from pathlib import Path
from shardserve.server.runtime.rings import create_ring
ring = create_ring(1, 2, 4096, Path(sys.argv[1]))
print(ring.path, flush=True)
time.sleep(60)
"""


def test_dead_rings_are_found_by_their_lock_not_their_pid(tmp_path: Path) -> None:
    """A ring left by a SIGKILLed server is removed even when its name carries a pid that is alive here (a containerised server is pid 1); a live server's ring is kept whatever its name."""
    procs, paths = [], []
    for _ in range(2):
        p = subprocess.Popen(
            [sys.executable, "-c", RING_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        assert p.stdout is not None
        procs.append(p)
        paths.append(Path(p.stdout.readline().strip()))
    # Rename both as a pid-1 server in another PID namespace would have named them.
    renamed = []
    for i, path in enumerate(paths):
        new = path.with_name(f"{PREFIX}1-{i}-cafe")
        path.rename(new)
        renamed.append(new)
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait(timeout=scaled(10))
    try:
        assert remove_stale(tmp_path) == [renamed[0].name]
        assert renamed[1].exists() and not renamed[0].exists()
    finally:
        procs[1].kill()
        procs[1].wait(timeout=scaled(10))
        for p in procs:
            assert p.stdout is not None
            p.stdout.close()
    assert remove_stale(tmp_path) == [renamed[1].name]


def test_own_ring_is_not_swept(tmp_path: Path) -> None:
    """A ring this process holds is never removed by its own sweep."""
    ring = create_ring(3, 2, 4096, tmp_path)
    try:
        assert remove_stale(tmp_path) == []
    finally:
        ring.close()
    assert not ring.path.exists()


def test_big_endian_arrays_ingest_with_their_values(tmp_path: Path) -> None:
    """Big-endian input is stored with the same values (no 'has dtype uint32, expected uint32')."""
    x = np.arange(40, dtype=">u4").reshape(20, 2)
    np.savez(tmp_path / "a.npz", x=x, y=np.arange(20, dtype=">f8"))
    np.savez(tmp_path / "b.npz", x=x + 100, y=np.arange(20, dtype="<f8"))
    store = tmp_path / "store"
    m = ingest(tmp_path, store, "be", progress=False).manifest
    assert m.num_samples == 40
    with Dataset.mapped(store / "be", m) as ds:
        got = ds.take(np.arange(40))
    np.testing.assert_array_equal(got["x"][:20], x.astype("<u4"))
    np.testing.assert_array_equal(got["x"][20:], (x + 100).astype("<u4"))
    np.testing.assert_array_equal(got["y"], np.concatenate([np.arange(20.0)] * 2))


def test_ingest_error_never_says_a_dtype_differs_from_itself(tmp_path: Path) -> None:
    """A real dtype mismatch still fails, with two different dtype names."""
    np.savez(tmp_path / "a.npz", x=np.arange(4, dtype=">u4"))
    np.savez(tmp_path / "b.npz", x=np.arange(4, dtype="<i8"))
    with pytest.raises(InvalidDataError) as e:
        ingest(tmp_path, tmp_path / "store", "bad", progress=False)
    assert "int64" in str(e.value) and "uint32" in str(e.value)


NPZ_INGEST = """
import sys
from pathlib import Path
from shardserve.server.store.ingest.run import ingest
m = ingest(Path(sys.argv[1]), Path(sys.argv[2]), "bomb", shard_bytes=16 << 20, progress=False)
hwm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(m.manifest.num_samples, hwm)
"""


@pytest.mark.slow
def test_compressed_npz_is_ingested_in_bounded_memory(tmp_path: Path) -> None:
    """A small .npz that decompresses to 384 MiB is ingested with a peak RSS far below that: members are streamed a block of rows at a time."""
    src = tmp_path / "src"
    src.mkdir()
    rows, row = 384, 1 << 20
    np.savez_compressed(src / "bomb.npz", x=np.zeros((rows, row), dtype=np.uint8))
    assert (src / "bomb.npz").stat().st_size < 4 << 20
    out = subprocess.run(
        [sys.executable, "-c", NPZ_INGEST, str(src), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    n, peak = map(int, out.stdout.split())
    assert n == rows
    assert peak < 250 << 20, f"peak RSS {peak >> 20} MiB while ingesting a {rows} MiB member"
