"""Every way preparing a stream can fail on the server reaches the client as its typed error,
with the server's reason, well within the deadline: before the Welcome too, where
the client does not know its stream id yet.

Each deadline here is shorter than the client's silence detection (3 heartbeats, 3 s), so an
error the client dropped would surface as ``DataStallError`` instead of the real reason.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from shardserve.client import (
    AuthError,
    BadRequest,
    DatasetCorruptError,
    DatasetNotFound,
    DataStallError,
    Loader,
    ProtocolError,
    ShardserveError,
)
from shardserve.client.connection import Connection
from shardserve.client.control import ControlClient
from shardserve.client.stats import StatsClock
from shardserve.client.stream import EpochStream
from shardserve.proto.jobs import JobSpec
from shardserve.proto.messages import PROTOCOL_VERSION, Hello
from tests.reliability.test_restart import _Restarter
from tests.support.data import make_cifar_like, sample_id_of
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

N = 300
DEADLINE_S = 2.5  # < 3 s: the client's silence detection must not be what ends the wait
#: A bound for waits that only a bug makes long (never met by a working client).
STEP_BOUND_S = 60.0


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    make_cifar_like(root, "cifar", n=N, shard_bytes=256 << 10)
    return root


def _ids(batch: dict) -> list[int]:
    return sample_id_of({k: v.numpy() for k, v in batch.items()}).tolist()


def _raises_quickly(exc: type[BaseException], run: Callable[[], object]) -> BaseException:
    t0 = time.monotonic()
    with pytest.raises(exc) as err:
        run()
    took = time.monotonic() - t0
    assert took < DEADLINE_S, f"{exc.__name__} took {took:.1f} s: {err.value}"
    return err.value


@pytest.mark.parametrize(("verify", "how"), [("full", "flip"), ("lazy", "delete")])
def test_a_corrupt_first_shard_reaches_the_loader_before_its_deadline(
    store: Path, tmp_path: Path, verify: str, how: str
) -> None:
    """The server fails the stream while preparing it (before any Welcome): the Loader raises
    DatasetCorruptError naming the shard, not a DataStallError, and a new Loader of the failed
    job gets the same reason at once."""
    victim = sorted((store / "cifar").rglob("*.arrow"))[0]
    if how == "delete":
        victim.unlink()
    else:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    with run_server(store, "--verify", verify, "--state-dir", str(tmp_path / "state")) as srv:

        def one_epoch() -> None:
            with Loader(srv.http_url, "cifar", 50, shuffle=False, timeout=DEADLINE_S) as loader:
                for _ in loader:
                    pass

        err = _raises_quickly(DatasetCorruptError, one_epoch)
        assert victim.name in str(err)
        again = _raises_quickly(ShardserveError, one_epoch)
        assert victim.name in str(again)


def test_a_job_deleted_between_epochs_is_created_again(store: Path) -> None:
    """An unknown job is not fatal: the client creates it again and the next epoch is whole."""
    with (
        run_server(store) as srv,
        Loader(srv.http_url, "cifar", 50, seed=1, timeout=DEADLINE_S * 4) as loader,
    ):
        first = [i for b in loader for i in _ids(b)]
        r = httpx.delete(f"{srv.http_url}/v1/jobs/{loader.job_id}", timeout=scaled(10))
        assert r.status_code == 200, r.text
        loader.set_epoch(1)
        second = [i for b in loader for i in _ids(b)]
        assert loader.stats().reconnects >= 1
    assert sorted(first) == sorted(second) == list(range(N))
    assert first != second


def test_a_stream_the_server_cannot_plan_raises_the_reason_not_a_stall(
    store: Path, tmp_path: Path
) -> None:
    """A job that outlived its dataset fails every Hello while the server plans it, and the Loader
    raises that reason within its deadline instead of re-sending Hellos until a DataStallError."""
    # The dataset was replaced by 200 samples while the server was down; the journal restores the
    # job of 300, and no Welcome comes. Once datasets have versions, the new data's own job streams.
    with _Restarter(store, tmp_path) as r:
        srv = r.start()
        Loader(srv.http_url, "cifar", 50, shuffle=False).close()  # the job, journaled
        srv.kill()
        shutil.rmtree(store / "cifar")
        make_cifar_like(store, "cifar", n=200, shard_bytes=256 << 10)
        srv = r.start()
        t0 = time.monotonic()
        try:
            with Loader(srv.http_url, "cifar", 50, shuffle=False, timeout=DEADLINE_S) as loader:
                ids = [i for b in loader for i in _ids(b)]
        except DataStallError as e:
            pytest.fail(f"the server's reason was lost: {e}")
        except ShardserveError as e:
            took = time.monotonic() - t0
            assert took < DEADLINE_S, f"took {took:.1f} s: {e}"
            assert "n_samples is 300" in str(e), e
        else:
            assert ids == list(range(200))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server for the refusals: each is of its own Hello and leaves nothing behind."""
    root = tmp_path_factory.mktemp("refusals") / "store"
    make_cifar_like(root, "cifar", n=N, shard_bytes=256 << 10)
    with run_server(root, "--token", "s3cret") as srv:
        yield srv


def _stream(srv: ServerProc, *, recreate: Callable[[], None] | None = None, **hello) -> None:
    """Open one stream with a hand-made Hello (what a Loader would never send) and read it."""
    spec = JobSpec(dataset="cifar", batch_size=50, world_size=2)
    with ControlClient(srv.http_url, "s3cret", timeout=scaled(10)) as api:
        job = api.create_job(spec).id  # the server's id covers the dataset version it pinned
    fields = {"job": job, "rank": 0, "epoch": 0, "credit": 2, "token": "s3cret"}
    conn = Connection(srv.ipc_endpoint or srv.tcp_endpoint)
    try:
        stream = EpochStream(
            conn,
            hello=Hello(**{**fields, **hello}),
            timeout=DEADLINE_S,
            stats=StatsClock(),
            recreate_job=recreate or (lambda: None),
            describe=lambda: "",
        )
        while stream.next() is not None:
            pass
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("hello", "exc", "words"),
    [
        ({"protocols": (PROTOCOL_VERSION + 1,)}, ProtocolError, "install matching shardserve"),
        ({"token": "wrong"}, AuthError, "a wrong token"),
        ({"token": ""}, AuthError, "no token"),
        ({"rank": 2}, BadRequest, "rank 2 out of range 0 <= rank < 2"),
        ({"start_batch": 4}, BadRequest, "start_batch 4 out of range 0 <= start_batch <= 3"),
    ],
)
def test_a_refused_hello_raises_its_typed_error(
    server: ServerProc, hello: dict, exc: type[BaseException], words: str
) -> None:
    """Version, token, rank and start batch refusals arrive as typed errors with the bound."""
    err = _raises_quickly(exc, lambda: _stream(server, **hello))
    assert words in str(err)


def test_an_unknown_job_that_cannot_be_created_again_raises_why(server: ServerProc) -> None:
    """A Hello for a job the server does not know makes the client re-create it; when that
    fails (its dataset is gone), that typed error is what the loop sees."""

    def recreate() -> None:
        raise DatasetNotFound("dataset 'cifar' is not in the store")

    err = _raises_quickly(DatasetNotFound, lambda: _stream(server, job="0" * 16, recreate=recreate))
    assert "'cifar'" in str(err)


def test_a_stream_never_waits_on_its_job_being_posted_again(server: ServerProc) -> None:
    """The re-post of a job a restarted server lost runs off the stream's thread: with the
    POST reaching the server but its answer never coming back (a name lookup of a restarted
    container has no timeout), the stream's next Hello finds the job and its batches flow."""
    spec = JobSpec(dataset="cifar", batch_size=50, world_size=2, seed=11)
    posted, release, answered = threading.Event(), threading.Event(), threading.Event()
    with ControlClient(server.http_url, "s3cret", timeout=scaled(10)) as api:
        job = api.create_job(spec).id
        httpx.delete(
            f"{server.http_url}/v1/jobs/{job}",
            headers={"Authorization": "Bearer s3cret"},
            timeout=scaled(10),
        ).raise_for_status()

        def recreate() -> None:
            api.create_job(spec)
            posted.set()
            release.wait(STEP_BOUND_S)  # the answer that never came
            answered.set()

        hello = Hello(job=job, rank=0, epoch=0, credit=2, token="s3cret")
        conn = Connection(server.ipc_endpoint or server.tcp_endpoint)
        try:
            stream = EpochStream(
                conn,
                hello=hello,
                timeout=STEP_BOUND_S,
                stats=StatsClock(),
                recreate_job=recreate,
                describe=lambda: "",
            )
            first = stream.next()
            assert first is not None and first[0].index == 0
            assert posted.is_set() and not answered.is_set(), "the stream waited for the re-post"
            assert stream.stats.reconnects >= 1
        finally:
            release.set()
            conn.close()
