"""In-process units of the server: settings validation, the epoch journal, buffer reuse."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from shardserve.proto.jobs import JobSpec, job_id
from shardserve.server.registry.jobs import EpochJournal, JobRegistry
from shardserve.server.settings import Settings
from shardserve.server.streaming.buffers import BufferPool


def test_settings_refuse_public_binds_without_token(tmp_path: Path) -> None:
    """A non-loopback http or data address needs a token or --insecure; loopback needs neither."""
    Settings(store=tmp_path)
    for kw in (
        {"http": "0.0.0.0:7070"},
        {"data": ["tcp://10.1.2.3:7071"]},
        {"data": ["tcp://*:7071"]},
    ):
        with pytest.raises(ValidationError, match="--insecure"):
            Settings(store=tmp_path, **kw)
        Settings(store=tmp_path, token="t", **kw)
        Settings(store=tmp_path, insecure=True, **kw)
    Settings(store=tmp_path, http="localhost:1", data=["tcp://[::1]:2", "ipc:///tmp/x"])


def test_settings_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SHARDSERVE_* variables fill settings; lists accept commas; init arguments (flags) win."""
    monkeypatch.setenv("SHARDSERVE_STORE", str(tmp_path))
    monkeypatch.setenv("SHARDSERVE_DATA", "tcp://127.0.0.1:1, tcp://127.0.0.1:2")
    monkeypatch.setenv("SHARDSERVE_ASSEMBLY_THREADS", "3")
    s = Settings()
    assert s.data == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"] and s.assembly_threads == 3
    assert s.state_path == tmp_path / ".shardserve"
    assert Settings(assembly_threads=1).assembly_threads == 1
    with pytest.raises(ValidationError, match="tcp:// or ipc://"):
        Settings(data=["udp://127.0.0.1:1"])


def test_journal_replays_and_compacts(tmp_path: Path) -> None:
    """A new registry on the same journal sees created jobs, epochs, seeds and deletions; a torn line is skipped."""
    path = tmp_path / "jobs.jsonl"
    reg = JobRegistry(EpochJournal(path))
    a, b = JobSpec(dataset="d", batch_size=2), JobSpec(dataset="d", batch_size=3, seed=5)
    ja, created = reg.create(a, 10)
    assert created and reg.create(a, 10) == (ja, False)
    reg.create(b, 10)
    reg.set_epoch(ja.id, 3, seed=8)
    reg.set_epoch(ja.id, 4)
    reg.delete(job_id(b))
    with open(path, "a") as f:
        f.write('{"op": "epoch", "id": "')  # a crash mid-append
    again = JobRegistry(EpochJournal(path))
    assert again.load() == 1
    job = again.get(ja.id)
    assert (job.epoch, job.seed, job.spec) == (4, 8, a)
    assert len(path.read_text().splitlines()) == 2  # one create and one epoch line


def test_buffer_pool_reuses_only_finished_sets() -> None:
    """A buffer set comes back for reuse after its send completed, never while zmq still holds it."""
    import zmq

    pool = BufferPool({"x": ("float32", (4,)), "y": None}, batch_size=8, capacity=2)
    first = pool.acquire()
    assert first is not None and first.arrays["x"].shape == (8, 4) and "y" not in first.arrays
    assert first.views(3)["x"].shape == (3, 4)

    class Pending(zmq.MessageTracker):
        def __init__(self) -> None:
            self.finished = False

        @property
        def done(self) -> bool:
            return self.finished

    tracker = Pending()
    pool.release(first, tracker)
    second = pool.acquire()
    assert second is not first
    tracker.finished = True
    assert pool.acquire() is first
    overflow = pool.acquire()
    assert overflow is not None and not overflow.pooled
    pool.release(overflow)  # past capacity: dropped, not kept
    pool.release(second)
    assert pool.acquire() is second and pool.acquire() is not overflow


def test_a_forfeited_buffer_set_is_never_handed_out_again() -> None:
    """A failed batch's set may still be written by a transform thread past its deadline: the
    pool makes a fresh one in its place and keeps its size."""
    pool = BufferPool({"x": ("float32", (4,))}, batch_size=8, capacity=2)
    a, b = pool.acquire(), pool.acquire()
    assert a is not None and b is not None and a.pooled and b.pooled
    pool.forfeit(a)
    pool.release(b)
    fresh = pool.acquire()
    again = pool.acquire()
    assert fresh is b and again is not None and again is not a and again.pooled
    assert pool.nbytes == 2 * 8 * 4 * 4
