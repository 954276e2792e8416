"""Same-host fast path: shared-memory slot rings between a real server and real Loaders."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from shardserve.client import Loader
from shardserve.proto.messages import ShmRing
from shardserve.server.runtime.rings import DEFAULT_DIR, PREFIX, create_ring
from shardserve.server.store.catalog import Store
from shardserve.server.streaming.shm import ShmSlots
from tests.support.data import make_cifar_like, make_graph_like, sample_id_of
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

pytestmark = pytest.mark.skipif(not DEFAULT_DIR.is_dir(), reason="no /dev/shm on this host")


def segments_of(pid: int) -> list[str]:
    return sorted(p.name for p in DEFAULT_DIR.glob(f"{PREFIX}{pid}-*"))


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    make_cifar_like(root, "cifar", n=600)
    make_graph_like(root, "graphs", n=150)
    return root


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProc]:
    with run_server(store) as srv:
        yield srv


def _epoch(url: str, dataset: str, transport: str, **kw) -> tuple[list[dict], str]:
    with Loader(url, dataset, 64, seed=3, transport=transport, **kw) as loader:
        loader.set_epoch(1)
        batches = [dict(b) for b in loader]
        return batches, loader.stats().transport


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return all(_same(getattr(a, k), getattr(b, k)) for k in ("values", "offsets", "shapes"))


@pytest.mark.parametrize(
    ("dataset", "kw"),
    [
        ("cifar", {}),
        ("graphs", {}),
        ("graphs", {"collate": "graph", "fields": ["x", "edge_index", "y"]}),
    ],
    ids=["cifar", "graphs", "graphs-collated"],
)
def test_shm_and_socket_deliver_identical_batches(
    server: ServerProc, dataset: str, kw: dict
) -> None:
    """The shm path and the socket path deliver byte-identical batches for the same plan
    (variable-size parts gathered and collated straight into the slot over shm)."""
    shm, t1 = _epoch(server.http_url, dataset, "auto", **kw)
    sock, t2 = _epoch(server.http_url, dataset, "socket", **kw)
    assert (t1, t2) == ("shm", "ipc")
    assert len(shm) == len(sock) > 1
    for a, b in zip(shm, sock, strict=True):
        assert a.keys() == b.keys()
        assert all(_same(a[k], b[k]) for k in a)


def _in_ring(loader: Loader, t: torch.Tensor) -> bool:
    mem = loader._ctx.rings.ring.slot_memory()  # type: ignore[union-attr]
    return mem.ctypes.data <= t.data_ptr() < mem.ctypes.data + mem.nbytes


def test_copied_batches_own_their_storage(server: ServerProc) -> None:
    """With copy=True (default) a batch stays intact after its slot is reused, a loop keeping every
    batch holding a slot until half the ring is held and then getting copies."""
    # prefetch=4 sends these batches two to a message, in a ring of 4 slots: the first two messages
    # stay in place.
    with Loader(server.http_url, "cifar", 50, shuffle="none", prefetch=4) as loader:
        batches = [b["image"] for b in loader]
        assert loader.stats().messages == len(batches) // 2
        assert loader.stats().copied == len(batches) - 4
        assert [_in_ring(loader, t) for t in batches[:5]] == [True] * 4 + [False]
    ids = [sample_id_of({"image": t.numpy()}) for t in batches]
    assert np.array_equal(np.concatenate(ids), np.arange(600))


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_small_rings_never_run_dry(server: ServerProc, prefetch: int) -> None:
    """Lending stops at half the ring, so a loop keeping every batch still gets them all."""
    with Loader(
        server.http_url, "cifar", 50, shuffle="none", prefetch=prefetch, timeout=scaled(5.0)
    ) as ld:
        batches = [b["image"] for b in ld]
        assert ld.stats().copied == len(batches) - prefetch // 2
    ids = [sample_id_of({"image": t.numpy()}) for t in batches]
    assert np.array_equal(np.concatenate(ids), np.arange(600))


def test_batches_are_lent_in_place_and_returned_when_dropped(server: ServerProc) -> None:
    """A loop that keeps only the current batch gets every batch in its slot, no copy: the
    slot goes back once the batch's tensors are gone, so the ring keeps cycling."""
    with Loader(server.http_url, "cifar", 20, shuffle="none", prefetch=4) as loader:
        seen = []
        for b in loader:
            assert _in_ring(loader, b["image"]) and _in_ring(loader, b["label"])
            seen.append(sample_id_of({"image": b["image"].numpy()}).copy())
        assert loader.stats().copied == 0 and len(seen) == 30
    assert np.array_equal(np.concatenate(seen), np.arange(600))


def test_a_held_batch_survives_the_next_epochs_on_the_reused_ring(server: ServerProc) -> None:
    """A batch kept past its epoch stays intact: the next stream takes over the client's ring
    but keeps that slot lent (Hello.keep) until the batch is dropped."""
    with Loader(server.http_url, "cifar", 50, shuffle=True, prefetch=4) as loader:
        it = iter(loader)
        first = next(it)
        kept = first["image"].clone()
        ring = loader._ctx.rings.ring
        assert _in_ring(loader, first["image"])
        seen = [sample_id_of({"image": kept.numpy()})]
        for _ in range(3):  # epochs 0, 1, 2: shuffled, so a reused slot would hold other samples
            seen += [sample_id_of({"image": b["image"].numpy()}).copy() for b in it]
            assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(600))
            assert loader._ctx.rings.ring is ring  # the same ring, reused across epochs
            assert torch.equal(first["image"], kept)
            it, seen = iter(loader), []
        del first
        next(it)
        next(it)  # the dropped batch's slot is reclaimed at a next(): no copies from here on
        copied = loader.stats().copied
        assert all(_in_ring(loader, b["image"]) for b in it)
        assert loader.stats().copied == copied


def test_copy_false_yields_views_into_the_slot(server: ServerProc) -> None:
    """copy=False yields tensors inside the shared ring, correct while the loop body runs."""
    with Loader(server.http_url, "cifar", 50, shuffle="none", prefetch=2, copy=False) as loader:
        seen = []
        for b in loader:
            ring = loader._ctx.active.ring  # type: ignore[union-attr]
            mem = ring.slot_memory()
            start = mem.ctypes.data
            assert start <= b["image"].data_ptr() < start + mem.nbytes
            seen.append(sample_id_of({"image": b["image"].numpy()}).copy())
    assert np.array_equal(np.concatenate(seen), np.arange(600))


def test_tiny_shm_limit_falls_back_with_one_clear_line(store: Path) -> None:
    """A ring that cannot be made falls back to the socket and logs how to give it room."""
    with run_server(store, "--shm-limit-bytes", "1") as srv:
        batches, transport = _epoch(srv.http_url, "cifar", "auto")
        log = srv.log_tail(20000)
    assert transport == "ipc" and len(batches) == 10
    lines = [ln for ln in log.splitlines() if "shm.fallback" in ln]
    assert len(lines) == 1, log
    assert "shm_size" in lines[0] and "--shm-size" in lines[0] and "ipc: host" in lines[0]


def test_ring_of_grown_batches_is_capped_and_serves_every_batch(store: Path) -> None:
    """A transform that quadruples each batch (uint8 to float32) under the default prefetch
    (sized from stored bytes: credit 54) would map credit x its batches; --shm-ring-bytes caps
    the ring at fewer slots, and a loop keeping every batch still gets them all, equal to the
    socket path's."""
    chain = [{"name": "normalize", "params": {"layout": "CHW", "scale": 1 / 255}}]
    with run_server(store, "--shm-ring-bytes", "4MiB") as srv:
        kw = dict(shuffle="none", transforms=chain, timeout=scaled(10.0))
        with Loader(srv.http_url, "cifar", 50, transport="auto", **kw) as ld:
            kept = [b["image"] for b in ld]
            assert ld.stats().transport == "shm" and ld.prefetch > 8
            (ring,) = [DEFAULT_DIR / n for n in segments_of(srv.proc.pid)]
            size = ring.stat().st_size
        with Loader(srv.http_url, "cifar", 50, transport="socket", **kw) as ld:
            want = [b["image"] for b in ld]
    batch_bytes = 50 * 3 * 32 * 32 * 4
    assert 2 * batch_bytes <= size <= 4 << 20, f"ring of {size} bytes"
    assert len(kept) == len(want) == 12
    assert all(torch.equal(a, b) for a, b in zip(kept, want, strict=True))


def test_no_shm_flag_serves_sockets(store: Path) -> None:
    """--no-shm turns the fast path off: same-host clients get the socket path."""
    with run_server(store, "--no-shm") as srv:
        assert _epoch(srv.http_url, "cifar", "auto")[1] == "ipc"
        assert segments_of(srv.proc.pid) == []


CLIENT = textwrap.dedent(
    """
    import sys, time
    from shardserve.client import Loader
    loader = Loader(sys.argv[1], "cifar", 20, prefetch=4)
    it = iter(loader)
    next(it)
    print("reading", flush=True)
    time.sleep(120)
    """
)


def test_killed_client_leaves_no_segment(server: ServerProc) -> None:
    """A client killed with SIGKILL mid-stream leaves no ring behind once the server notices."""
    before = set(segments_of(server.proc.pid))
    with subprocess.Popen(
        [sys.executable, "-c", CLIENT, server.http_url], stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "reading"
            assert set(segments_of(server.proc.pid)) - before, "the client did not get a ring"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=scaled(10))
            wait_until(
                lambda: set(segments_of(server.proc.pid)) <= before,
                30,
                "the dead client's ring to go",
            )
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=scaled(10))


def test_restart_removes_stale_segments(store: Path) -> None:
    """Rings of a server killed with SIGKILL are removed when the next server starts."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=scaled(10))
    planted = DEFAULT_DIR / f"{PREFIX}{dead.pid}-7-deadbeef"
    planted.write_bytes(b"\0" * 64)
    with run_server(store) as srv:
        loader = Loader(srv.http_url, "cifar", 20, prefetch=3)
        next(iter(loader))
        left = segments_of(srv.proc.pid)
        assert left, "the stream got no ring"
        srv.kill()  # a killed server cannot clean up: the next one to start does
        loader.close()
    # (Whether its ring is still there now is not asserted: a server another test starts
    # meanwhile sweeps it too.)
    with run_server(store):
        pass
    assert segments_of(srv.proc.pid) == [] and not planted.exists()


def test_variable_parts_are_made_in_the_slot_not_copied_there(store: Path) -> None:
    """``take`` gathers variable-size values, and graph collation lays out its shifted
    ``edge_index``, straight into the slot's tail: placing the batch copies none of them,
    and the bytes are those of a take into fresh memory."""
    from shardserve.proto.jobs import GraphOptions
    from shardserve.server.store.read.graphs import GraphCollated

    stored = Store(store).open("graphs")
    fields = ("x", "edge_index", "y")
    ids = np.arange(40, 48)
    for ds in (stored, GraphCollated(stored, 8, GraphOptions())):
        slots = ShmSlots.create(1, 2, ds, fields, 8, DEFAULT_DIR, None)
        try:
            slot = slots.acquire()
            assert slot is not None
            tail = slots.tail(slot)
            parts = ds.take(ids, fields, out=slots.out(slot, 8), tail=tail)
            placed = tail(parts)
            assert slots.headers(slot, placed) is not None
            assert placed["x"] is parts["x"] and placed["edge_index"] is parts["edge_index"]
            want = ds.take(ids, fields)
            assert placed.keys() == want.keys()
            assert all(placed[k].tobytes() == want[k].tobytes() for k in want)
        finally:
            slots.close()


def test_variable_overflow_goes_to_the_socket(store: Path) -> None:
    """A batch whose variable parts exceed the slot's budget is left for the socket, not truncated."""
    ds = Store(store).open("graphs")
    fields = tuple(f.name for f in ds.fields)
    slots = ShmSlots.create(1, 2, ds, fields, 8, DEFAULT_DIR, None)
    try:
        slot = slots.acquire()
        assert slot is not None
        parts = ds.take(np.arange(8), fields, out=slots.out(slot, 8))
        placed = slots.tail(slot)(parts)
        assert slots.headers(slot, placed) is not None  # a typical batch fits
        huge = {**parts, "x": np.zeros(slots.ring.slot_bytes, dtype=np.float32)}
        assert slots.tail(slot)(huge) is huge
        assert slots.headers(slot, huge) is None
    finally:
        slots.close()
    assert not slots.ring.path.exists()


def test_ring_creation_refuses_what_does_not_fit(tmp_path: Path) -> None:
    """A ring over the limit or in a missing folder is refused with the reason, leaving no file."""
    with pytest.raises(Exception, match="--shm-limit-bytes"):
        create_ring(1, 4, 1 << 20, DEFAULT_DIR, limit_bytes=1 << 10)
    with pytest.raises(Exception, match="does not exist"):
        create_ring(1, 4, 1 << 20, tmp_path / "missing")
    assert segments_of(os.getpid()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_cuda_registration_falls_back_on_cpu() -> None:
    """Without CUDA a ring is not registered, so batches take the staged (pinned-pool) path."""
    from shardserve.client.device import register_host_memory
    from shardserve.client.shm import AttachedRing

    ring = create_ring(2, 2, 4096)
    try:
        ring_info = ShmRing(name=ring.name, slots=ring.slots, slot_bytes=ring.slot_bytes)
        attached = AttachedRing(ring_info)
        assert register_host_memory(attached.slot_memory()) is False
        closed_with = []
        attached.on_close = lambda buf: closed_with.append(buf.nbytes)
        attached.close()
        assert closed_with == [ring_info.slots * ring_info.slot_bytes]
    finally:
        ring.close()


def test_a_slot_says_which_file_and_offset_an_array_in_it_lives_at() -> None:
    """A slot answers the file and byte offset of an array inside it, and nothing for an array of another slot, fresh memory or a strided view."""
    from shardserve.server.source import FRESH, FileSpan
    from shardserve.server.streaming.shm import SlotTail

    ring = create_ring(3, 2, 4096)
    try:
        first, second = SlotTail(ring, 0, 0), SlotTail(ring, 1, 0)
        a = ring.slot_array(1, 128, np.dtype(np.float32), (4, 8))
        assert second.span_of(a) == FileSpan(str(ring.path), ring.slot_bytes + 128, 128)
        assert second.span_of(a[1:3]) == FileSpan(str(ring.path), ring.slot_bytes + 160, 64)
        assert first.span_of(a) is None
        assert second.span_of(a[:, ::2]) is None
        assert second.span_of(np.zeros(4)) is None
        assert FRESH.span_of(a) is None
        # What the span names is where the array lies: another mapping of the file reads it.
        a[...] = np.arange(32, dtype=np.float32).reshape(4, 8)
        span = second.span_of(a)
        assert span is not None
        with open(span.path, "rb") as f:
            f.seek(span.offset)
            got = np.frombuffer(f.read(span.nbytes), dtype=np.float32)
        assert got.tobytes() == a.tobytes()
    finally:
        ring.close()
