"""A chain writes its fixed-size outputs where the batch is sent from (the stream's slot or
buffer) instead of copying them there: the last step of a chain gets ``out=`` when it takes
it, sample outputs are stacked into place, and the bytes are those of a run without ``out``;
worker processes write them straight into the stream's shared memory. A run whose piece
failed returns only once its other pieces stopped writing."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from shardserve.client import Loader
from shardserve.proto.errors import TransformError
from shardserve.server.transforms.errors import StepFailed
from shardserve.server.transforms.metrics import TransformMetrics
from shardserve.server.transforms.pool import TransformPool
from shardserve.server.transforms.registry import TransformRegistry
from shardserve.server.transforms.runner import Where, run_chain
from shardserve.server.transforms.schema import Field
from shardserve.server.transforms.spec import compile_chain
from tests.support.server import run_server
from tests.support.slowness import scaled
from tests.transforms import mods
from tests.transforms.conftest import CIFAR_CHAIN, N, digest, pool_status

REG = TransformRegistry.load(["tests.transforms.mods"])
W = Where(seed=3, epoch=2, rank=0, batch=7)
B = 12
IMAGE = {"image": Field("uint8", (3, 8, 8))}
NORM = {
    "name": "normalize",
    "params": {
        "field": "image",
        "layout": "CHW",
        "scale": 1 / 255,
        "mean": [0.5, 0.4, 0.3],
        "std": [0.2, 0.3, 0.4],
    },
}
FLIP = {"name": "hflip", "params": {"field": "image", "layout": "CHW"}}


def _images() -> dict[str, np.ndarray]:
    return {"image": np.random.default_rng(1).integers(0, 256, (B, 3, 8, 8), dtype=np.uint8)}


def _both(steps: list, inputs: dict, parts: dict, out: dict) -> tuple[dict, dict]:
    chain = compile_chain(steps, REG, inputs, "t")
    names = list(chain.outputs)
    idx = np.arange(40, 40 + B)
    alone, _ = run_chain(chain, parts, idx, W, names)
    into, _ = run_chain(chain, parts, idx, W, names, out=out)
    return alone, into


@pytest.mark.parametrize(
    "steps", [[NORM], [FLIP, NORM], [NORM, FLIP]], ids=["norm", "flip-norm", "norm-flip"]
)
def test_the_chain_writes_into_the_batch_memory_with_the_same_bytes(steps: list) -> None:
    dest = np.full((B, 3, 8, 8), np.nan, np.float32)
    alone, into = _both(steps, IMAGE, _images(), {"image": dest})
    assert into["image"] is dest
    assert into["image"].tobytes() == alone["image"].tobytes()
    assert alone["image"] is not dest and not np.isnan(dest).any()


@pytest.mark.parametrize("dtype", ["float32", "bool", "uint8"])
def test_unpacked_bits_land_in_place(dtype: str) -> None:
    packed = np.random.default_rng(2).integers(0, 256, (B, 11), dtype=np.uint8)
    step = {
        "name": "unpack_bits",
        "params": {"field": "packed", "shape": [2, 5, 8], "dtype": dtype, "to": "planes"},
    }
    dest = np.zeros((B, 2, 5, 8), dtype)
    alone, into = _both(
        [step], {"packed": Field("uint8", (11,))}, {"packed": packed}, {"planes": dest}
    )
    want = np.unpackbits(packed, axis=1, count=80).reshape(B, 2, 5, 8).astype(dtype)
    assert into["planes"] is dest
    np.testing.assert_array_equal(dest, want)
    np.testing.assert_array_equal(alone["planes"], want)


def test_sample_outputs_are_stacked_into_place() -> None:
    rng = np.random.default_rng(3)
    pts = [rng.normal(size=(int(n), 3)).astype(np.float32) for n in rng.integers(20, 40, B)]
    offsets = np.zeros(B + 1, np.int64)
    np.cumsum([p.size for p in pts], out=offsets[1:])
    parts = {
        "points": np.concatenate([p.ravel() for p in pts]),
        "points.offsets": offsets,
        "points.shapes": np.array([p.shape for p in pts], np.int64),
    }
    step = {"name": "random_subset", "params": {"field": "points", "n": 16}}
    dest = np.full((B, 16, 3), np.nan, np.float32)
    alone, into = _both([step], {"points": Field("float32", (-1, 3))}, parts, {"points": dest})
    assert into["points"] is dest
    assert into["points"].tobytes() == alone["points"].tobytes()


def test_only_the_last_step_gets_the_memory_and_only_when_it_takes_it() -> None:
    labels = {"label": np.arange(B, dtype=np.int64)}
    double = {"name": "double_into"}
    keep = {"name": "fail_labels", "params": {"labels": []}}
    for steps, given in (([double], [True]), ([double, keep], [False]), ([keep, double], [True])):
        mods.GOT_OUT.clear()
        dest = np.full(B, -1, np.int64)
        chain = compile_chain(steps, REG, {"label": Field("int64", ())}, "t")
        into, _ = run_chain(chain, labels, np.arange(B), W, ["label"], out={"label": dest})
        seen = list(mods.GOT_OUT)
        assert seen == given, steps
        assert into["label"] is dest and dest.tolist() == [2 * i for i in range(B)]


def test_sample_outputs_need_no_batch_sized_temporary() -> None:
    """Stacked where the batch goes, a sample step's outputs allocate no second batch."""
    rng = np.random.default_rng(4)
    pts = rng.normal(size=64 * 4096 * 3).astype(np.float32)
    x = {
        "points": pts,
        "points.offsets": np.arange(0, 64 * 4096 * 3 + 1, 4096 * 3),
        "points.shapes": np.full((64, 2), [4096, 3], np.int64),
    }
    step = {"name": "head_rows", "params": {"n": 2048}}
    chain = compile_chain([step], REG, {"points": Field("float32", (-1, 3))}, "t")
    dest = np.zeros((64, 2048, 3), np.float32)

    def peak(out: dict | None) -> int:
        tracemalloc.start()
        try:
            run_chain(chain, x, np.arange(64), W, ["points"], out=out)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    assert peak(None) - peak({"points": dest}) >= 0.9 * dest.nbytes


def test_memory_of_another_layout_is_left_alone() -> None:
    """A destination that does not have the declared dtype is not written; the output is."""
    dest = np.zeros((B, 3, 8, 8), np.float64)
    alone, into = _both([NORM], IMAGE, _images(), {"image": dest})
    assert into["image"] is not dest and not dest.any()
    assert into["image"].tobytes() == alone["image"].tobytes()


def test_a_failed_piece_returns_after_the_other_pieces_wrote() -> None:
    """A retry of the batch (failing samples replaced) writes the same memory: the run that
    failed must not return while another of its pieces still writes its rows into it."""
    pool = TransformPool(
        2, "thread", ["tests.transforms.mods"], 60.0, TransformMetrics(CollectorRegistry())
    )
    try:
        step = {"name": "fail_or_wait", "params": {"fail": 1, "wait": 4, "seconds": 0.5}}
        chain = compile_chain([step], REG, {"label": Field("int64", ())}, "t")
        labels = np.array([1, 2, 3, 4], np.int64)  # piece 1: rows 0-1 fail; piece 2: 2-3 wait
        out = {"label": np.full(4, -1, np.int64)}
        mods.WAITING.clear()

        def describe(what: str) -> TransformError:
            return TransformError(what)

        with pytest.raises(StepFailed) as failed:
            pool.run(chain, {"label": labels}, np.arange(4), W, ["label"], describe, out)
        assert failed.value.position == 0
        assert out["label"][2:].tolist() == [3, 4], "returned while a piece was still writing"
    finally:
        pool.close()


def test_worker_processes_write_outputs_straight_into_the_streams_shared_memory(
    store: Path, no_leftovers: list[int]
) -> None:
    """Worker processes write the chain's outputs into the stream's shared-memory slots (over a
    socket, through their pipe) and read every input byte from their input files, with a thread
    pool's batches."""
    # Over shared memory the outputs (float32 images and the labels) are counted byte for byte and
    # shown on the status page; over a socket the same bytes come back through the worker's pipe.
    # Either way every input byte (images, labels, sample ids) reaches the workers through their
    # input files, not the pipe.

    def epoch(url: str, transport: str) -> tuple[list[str], int]:
        with Loader(
            url,
            "cifar",
            batch_size=50,
            seed=3,
            transforms=CIFAR_CHAIN,
            timeout=scaled(30),
            transport=transport,
        ) as ld:  # type: ignore[arg-type]
            batches = list(ld)
            return [digest(b) for b in batches], sum(t.nbytes for b in batches for t in b.values())

    with run_server(store, "--transform-pool", "thread") as srv:
        want, served = epoch(srv.http_url, "auto")
    assert served == N * (3 * 32 * 32 * 4 + 8)
    with run_server(store, "--transform-pool", "process", "--transform-workers", "2") as srv:
        no_leftovers.append(srv.proc.pid)
        assert epoch(srv.http_url, "tcp")[0] == want
        status = pool_status(srv.http_url)
        no_leftovers.extend(status["pool"]["pids"])
        assert status["counts"].get("worker_bytes_in_place", 0) == 0, status["counts"]
        assert epoch(srv.http_url, "auto")[0] == want
        counts = pool_status(srv.http_url)["counts"]
        assert counts["worker_bytes_in_place"] == served, counts
        inputs = 2 * N * (3 * 32 * 32 + 8 + 8)  # two epochs of uint8 images, labels, ids
        assert counts["worker_input_bytes_via_shm"] == inputs, counts
        page = httpx.get(f"{srv.http_url}/", timeout=scaled(10)).text
        assert f"into streams' shared memory {served / 2**20:,.1f} MiB" in page
        assert f"read from shared memory {inputs / 2**20:,.1f} MiB" in page


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def test_a_worker_writes_only_inside_its_span_and_unmaps_removed_files(tmp_path: Path) -> None:
    """A span is written exactly where it says; one past the file's end or of another size
    than the output is refused; a file removed by the server is unmapped at the next sweep
    (a mapping would keep a finished stream's memory allocated)."""
    from shardserve.server.transforms.worker import MappedFiles

    ring = tmp_path / "ring"
    ring.write_bytes(bytes(4096))
    files = MappedFiles()
    dt = np.dtype(np.float32)
    view = files.view({"path": str(ring), "offset": 128, "nbytes": 64}, dt, (4, 4))
    view[:] = 1.5
    del view
    data = np.fromfile(ring, dtype=np.float32)
    assert (data[32:48] == 1.5).all() and not data[:32].any() and not data[48:].any()
    for span, shape in (
        ({"offset": 4032, "nbytes": 128}, (8, 4)),
        ({"offset": 0, "nbytes": 60}, (4, 4)),
        ({"offset": 2, "nbytes": 64}, (4, 4)),
    ):
        with pytest.raises(ValueError, match="does not hold"):
            files.view({"path": str(ring), **span}, dt, shape)
    assert _mapped(ring)
    files.sweep()
    assert _mapped(ring), "a file still in place stays mapped"
    ring.unlink()
    files.sweep()
    assert not _mapped(ring)


def _input_files(worker: int) -> list[Path]:
    from shardserve.server.runtime.rings import DEFAULT_DIR, PREFIX

    return sorted(DEFAULT_DIR.glob(f"{PREFIX}{os.getpid()}-{worker}-*"))


def test_worker_processes_read_their_inputs_from_a_shared_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker process reads each request's inputs (variable-size points, the sample ids)
    from a shared-memory file of its own, counted byte for byte; a request that needs more
    gets a bigger file (the old one removed); one over the limit goes on the pipe; the same
    points come back every way, and closing the pool leaves no file."""
    from shardserve.server.transforms import pool_processes

    step = {"name": "random_subset", "params": {"field": "points", "n": 64}}
    chain = compile_chain([step], REG, {"points": Field("float32", (-1, 3))}, "t")
    rng = np.random.default_rng(5)

    def batch(rows: int) -> dict[str, np.ndarray]:
        n = np.full(4, rows, np.int64)
        offsets = np.concatenate([[0], np.cumsum(n * 3)])
        values = rng.normal(size=int(offsets[-1])).astype(np.float32)
        return {
            "points": values,
            "points.offsets": offsets,
            "points.shapes": np.stack([n, np.full(4, 3)], 1),
        }

    def describe(what: str) -> TransformError:
        return TransformError(what)

    metrics = TransformMetrics(CollectorRegistry())
    pool = TransformPool(1, "process", ["tests.transforms.mods"], 30.0, metrics)
    idx = np.arange(100, 104)
    try:
        sent = 0
        for rows, via_file in ((200, True), (40_000, True), (400_000, False)):
            if not via_file:
                monkeypatch.setattr(pool_processes, "INPUT_FILE_MAX", 1 << 20)
            parts = batch(rows)
            got = pool.run(chain, parts, idx, W, ["points"], describe)
            want, _ = run_chain(chain, parts, idx, W, ["points"])
            assert got["points"].tobytes() == want["points"].tobytes()
            if via_file:
                sent += sum(a.nbytes for a in parts.values()) + idx.nbytes
            assert metrics.snapshot().get("worker_input_bytes_via_shm", 0) == sent, rows
            (worker,) = pool.pids()
            files = _input_files(worker)
            assert len(files) == 1, files  # a bigger one replaced the first
            need = sum(a.nbytes for a in parts.values())
            assert via_file == (files[0].stat().st_size >= need), (rows, files)
        assert pool.status()["input_file_bytes"] == files[0].stat().st_size
    finally:
        pool.close()
    assert not _input_files(worker)
