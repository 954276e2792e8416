"""``/dev/shm`` cleaned under a running server (systemd-logind's ``RemoveIPC``, container
runtimes, cron): the files the server keeps there are made again when they are missing, so
process-pool transform jobs keep working, live streams included, without a restart."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from shardserve.client import Loader
from shardserve.proto.errors import TransformError
from shardserve.server.runtime.rings import DEFAULT_DIR, PREFIX, create_ring
from shardserve.server.streaming.shm import SlotTail
from shardserve.server.transforms import codec
from shardserve.server.transforms.metrics import TransformMetrics
from shardserve.server.transforms.pool import TransformPool
from shardserve.server.transforms.registry import TransformRegistry
from shardserve.server.transforms.runner import Where, run_chain
from shardserve.server.transforms.schema import Field
from shardserve.server.transforms.spec import compile_chain
from shardserve.server.transforms.worker import main as worker_main
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled
from tests.transforms.conftest import MIXED_CHAIN, MODS, digest, pool_status, shm_segments

pytestmark = pytest.mark.skipif(not DEFAULT_DIR.is_dir(), reason="no /dev/shm on this host")

BATCH = 50


@pytest.fixture
def srv(store: Path) -> Iterator[ServerProc]:
    with run_server(store, *MODS, "--transform-pool", "process", "--transform-workers", "2") as s:
        yield s


def _clean_shm(pid: int) -> list[str]:
    """Remove every file of server ``pid`` in /dev/shm, as a cleanup job would; their names."""
    gone = []
    for p in DEFAULT_DIR.glob(f"{PREFIX}{pid}-*"):
        p.unlink(missing_ok=True)
        gone.append(p.name)
    return gone


def _loader(srv: ServerProc) -> Loader:
    return Loader(
        srv.http_url,
        "cifar",
        batch_size=BATCH,
        seed=1,
        shuffle=False,
        prefetch=2,
        timeout=scaled(20.0),
        transforms=MIXED_CHAIN,
    )


def _epochs(srv: ServerProc, epochs: int = 2) -> list[list[str]]:
    """The digest of every batch of ``epochs`` epochs of one fresh Loader."""
    with _loader(srv) as ld:
        out = []
        for e in range(epochs):
            ld.set_epoch(e)
            out.append([digest(b) for b in ld])
        assert ld.stats().transport == "shm"
        return out


def test_a_fresh_loader_streams_after_shm_is_cleaned_between_jobs(srv: ServerProc) -> None:
    """Every file of the server in /dev/shm removed between two jobs: the next process-pool
    transform job (a fresh Loader) streams every batch, byte-identical to before, and the
    server's input files for its workers are there again."""
    want = _epochs(srv, 1)
    assert pool_status(srv.http_url)["pool"]["input_file_bytes"] > 0  # inputs go by /dev/shm
    assert _clean_shm(srv.proc.pid), "the job left no file in /dev/shm to remove"
    assert _epochs(srv, 1) == want
    assert shm_segments(srv.proc.pid), "the server's worker input files were not made again"
    assert _clean_shm(srv.proc.pid)
    assert _epochs(srv, 1) == want  # and again: not only the first cleanup


def test_a_live_stream_keeps_streaming_when_shm_is_cleaned_between_batches(
    srv: ServerProc,
) -> None:
    """/dev/shm cleaned while a Loader is between two batches of its epoch (its ring, the
    workers' input files): every batch still arrives byte-identical, the same Loader's next
    epoch too (on a new ring), and so does a fresh Loader's."""
    want = _epochs(srv, 2)
    n = len(want[0])
    assert n >= 4
    workers = pool_status(srv.http_url)["pool"]["pids"]
    with _loader(srv) as ld:
        got: list[list[str]] = [[], []]
        for e in range(2):
            ld.set_epoch(e)
            for i, b in enumerate(ld):
                got[e].append(digest(b))
                if e == 1 and i == 0:  # the removed ring was not handed over: a new one
                    rings = [
                        s
                        for s in shm_segments(srv.proc.pid)
                        if not any(f"-{w}-" in s for w in workers)
                    ]
                    assert rings, shm_segments(srv.proc.pid)
                if i in (1, n // 2):
                    assert _clean_shm(srv.proc.pid)
        assert ld.stats().transport == "shm"
    assert got == want
    assert _epochs(srv, 2) == want


def test_outputs_whose_ring_file_is_gone_come_back_on_the_pipe() -> None:
    """A worker process asked to write its outputs into a stream's ring whose file was
    removed (it cannot open it by name; the server still has it mapped) sends them back on
    its pipe, and the server copies them into its own mapping: the batch is whole, no error."""
    reg = TransformRegistry.load(["tests.transforms.mods"])
    norm = {
        "name": "normalize",
        "params": {
            "field": "image",
            "layout": "CHW",
            "scale": 1 / 255,
            "mean": [0.5] * 3,
            "std": [0.25] * 3,
        },
    }
    chain = compile_chain([norm], reg, {"image": Field("uint8", (3, 8, 8))}, "t")
    images = np.random.default_rng(0).integers(0, 256, (12, 3, 8, 8), dtype=np.uint8)
    where, idx = Where(seed=3, epoch=0, rank=0, batch=0), np.arange(12)
    want, _ = run_chain(chain, {"image": images}, idx, where, ["image"])
    metrics = TransformMetrics(CollectorRegistry())
    pool = TransformPool(1, "process", ["tests.transforms.mods"], scaled(30.0), metrics)
    ring = create_ring(0, 1, 12 * 3 * 8 * 8 * 4)
    try:
        out = {"image": ring.slot_array(0, 0, np.dtype(np.float32), (12, 3, 8, 8))}
        ring.path.unlink()  # what a cleanup of /dev/shm does
        assert not ring.on_disk()
        slot = SlotTail(ring, 0, ring.slot_bytes)  # the slot says where ``out`` lives
        assert slot.span_of(out["image"]) is not None
        got = pool.run(chain, {"image": images}, idx, where, ["image"], TransformError, out, slot)
        assert got["image"].tobytes() == want["image"].tobytes()
        assert out["image"].tobytes() == want["image"].tobytes()  # in the ring's slot
        assert metrics.snapshot().get("worker_bytes_in_place", 0) == 0
    finally:
        pool.close()
        ring.close()


def test_a_worker_whose_input_file_is_gone_asks_for_its_inputs_on_the_pipe(
    tmp_path: Path,
) -> None:
    """The server checks a worker's input file before each request, but a cleanup may remove
    it before the worker maps it: the worker answers ``inputs_gone`` naming the file (the
    server then sends the request again with its inputs on the pipe), and answers that one."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=worker_main, args=(child, ["tests.transforms.mods"]), daemon=True)
    proc.start()
    child.close()
    try:
        assert conn.poll(scaled(60.0)), "the worker did not start"
        assert conn.recv_bytes() == b"ready"
        flip = {"name": "hflip", "params": {"field": "image", "layout": "CHW"}}
        images = np.arange(2 * 3 * 4 * 4, dtype=np.uint8).reshape(2, 3, 4, 4)
        arrays = {"image": images, "__indices__": np.arange(2, dtype=np.int64)}
        meta = {
            "chain": [flip],
            "names": ["image"],
            "limits": {},
            "out": {},
            "inputs": {"image": {"dtype": "uint8", "shape": [3, 4, 4], "binary": False}},
            "where": {"seed": 0, "epoch": 0, "rank": 0, "batch": 0},
        }
        gone = tmp_path / "removed-input-file"
        laid = [
            {
                "name": n,
                "dtype": a.dtype.str,
                "shape": list(a.shape),
                "offset": 0,
                "nbytes": a.nbytes,
            }
            for n, a in arrays.items()
        ]
        codec.send(conn, {**meta, "in": {"path": str(gone), "arrays": laid}}, {})
        assert conn.poll(scaled(30.0)), "no answer from the worker"
        reply, parts = codec.recv(conn)
        assert reply["ok"] is False and str(gone) in reply["inputs_gone"], reply
        assert parts == {}
        codec.send(conn, meta, arrays)
        assert conn.poll(scaled(30.0)), "no answer from the worker"
        reply, parts = codec.recv(conn)
        assert reply["ok"] is True, reply
        reg = TransformRegistry.load(["tests.transforms.mods"])
        chain = compile_chain([flip], reg, {"image": Field("uint8", (3, 4, 4))}, "t")
        want, _ = run_chain(chain, {"image": images}, np.arange(2), Where(0, 0, 0, 0), ["image"])
        assert parts["image"].tobytes() == want["image"].tobytes()
    finally:
        conn.close()
        proc.join(scaled(10.0))
        if proc.is_alive():
            proc.kill()
