"""Deadlines, clean shutdown and serve_local, with real processes and sockets."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import httpx
import pytest

from shardserve.client import (
    DatasetCorruptError,
    DataStallError,
    Loader,
    ServerUnavailable,
    ShardserveError,
    serve_local,
)
from shardserve.server.planning import plan
from shardserve.server.runtime.rings import remove_stale
from tests.client.conftest import N_CIFAR, ids
from tests.support.data import make_cifar_like
from tests.support.server import free_port, run_server
from tests.support.slowness import scaled


def _sockets() -> int:
    """Open socket descriptors of this process."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed between listdir and readlink
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return n


def test_stopped_server_raises_datastall_within_timeout(store) -> None:
    """When the server dies mid-epoch the loop raises DataStallError, saying what it knows, within
    about `timeout` seconds instead of hanging."""
    with run_server(store) as srv:
        loader = Loader(srv.http_url, "cifar", 20, rank=0, world_size=1, prefetch=2, timeout=2.0)
        it = iter(loader)
        for _ in range(3):
            next(it)
        srv.kill()
        start = time.monotonic()
        with pytest.raises(DataStallError) as info:
            for _ in it:
                pass
        waited = time.monotonic() - start
        loader.close()
    # A killed server's slot rings wait for the next server start to remove them; none follows here.
    remove_stale()
    msg = str(info.value)
    assert (
        "does not answer GET /healthz" in msg
        and "last batch received" in msg
        and "credit outstanding" in msg
    )
    assert waited < 2.0 * 3, (
        f"raised after {waited:.1f} s with timeout=2"
    )  # generous: a bound, not a timing


def test_close_leaves_no_threads_or_sockets(server) -> None:
    """After close() (and after a `with` block) no Python or native thread and no socket of the Loader remains."""
    threads = {t.ident for t in threading.enumerate()}
    native = len(os.listdir("/proc/self/task"))  # libzmq's I/O and reaper threads are native
    socks = _sockets()
    for _ in range(2):
        loader = Loader(server.http_url, "cifar", 50, rank=0, world_size=1)
        next(iter(loader))
        loader.close()
        loader.close()  # idempotent
    with Loader(server.http_url, "cifar", 50, rank=0, world_size=1) as loader:
        for _ in loader:
            break
    assert {t.ident for t in threading.enumerate()} == threads
    assert len(os.listdir("/proc/self/task")) == native
    assert _sockets() == socks
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def test_garbage_collected_loader_closes_itself(server) -> None:
    """A Loader dropped without close() releases its sockets when collected."""
    socks = _sockets()
    loader = Loader(server.http_url, "cifar", 50, rank=0, world_size=1)
    next(iter(loader))
    del loader
    assert _sockets() == socks


def test_serve_local_starts_and_stops_a_server(store) -> None:
    """serve_local yields a ready server's URL and leaves nothing listening after the block."""
    with serve_local(store) as url:
        assert httpx.get(f"{url}/readyz", timeout=scaled(5)).status_code == 200
        with Loader(url, "cifar", 500, rank=0, world_size=1) as loader:
            assert sum(len(b["label"]) for b in loader) == 1000
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/healthz", timeout=1)  # unscaled: nothing is expected to answer


def test_an_https_url_to_the_plain_http_server_is_named_at_once(server) -> None:
    """The TLS handshake fails: said at once, not retried for the whole timeout and then
    reported as a server that refused the connection."""
    url = server.http_url.replace("http://", "https://")
    with pytest.raises(ServerUnavailable, match=r"TLS handshake failed .*use an http:// URL"):
        Loader(url, "cifar", 50, rank=0, world_size=1, timeout=600.0)


def test_a_url_with_a_path_after_the_base_says_so(server) -> None:
    """``http://HOST:PORT/v1``: the server has no ``/v1/v1/jobs``; the error says to give the
    base URL instead of a bare 404."""
    with pytest.raises(ShardserveError, match=r"no route /v1/v1/.*give the server's base URL"):
        Loader(f"{server.http_url}/v1", "cifar", 50, rank=0, world_size=1, timeout=scaled(30.0))


def test_serve_local_of_a_missing_store_says_the_server_exited(tmp_path) -> None:
    """A server that exits at start (no such store) is reported as exited, with its reason,
    not as "not ready within 30 s"."""
    with (
        pytest.raises(ServerUnavailable, match=r"exited with code 2 before it was ready") as e,
        serve_local(tmp_path / "no-such-store"),
    ):
        pass
    assert "no-such-store does not exist" in str(e.value)


def test_server_restart_mid_epoch_loses_and_repeats_nothing(store, tmp_path) -> None:
    """A server killed with SIGKILL and restarted on the same endpoints: the loop re-opens its
    stream at the next undelivered batch and the epoch arrives exactly once."""
    http, data = free_port(), free_port()
    workdir = tmp_path / "srv"
    with run_server(store, http_port=http, data_port=data, workdir=workdir) as srv:
        loader = Loader(
            srv.http_url,
            "cifar",
            50,
            seed=4,
            rank=0,
            world_size=1,
            prefetch=2,
            timeout=scaled(30.0),
        )
        loader.set_epoch(3)
        it = iter(loader)
        got = [ids(next(it)) for _ in range(5)]
        srv.kill()
    with run_server(store, http_port=http, data_port=data, workdir=workdir):
        got += [ids(b) for b in it]
        assert loader.stats().reconnects >= 1
        loader.close()
    want = plan(N_CIFAR, seed=4, epoch=3, world_size=1, rank=0, batch_size=50)
    assert got == [tuple(int(i) for i in b) for b in want]


def test_corrupt_shard_raises_a_typed_error_promptly(tmp_path) -> None:
    """A flipped byte in a shard reaches the loop as DatasetCorruptError, well before `timeout`."""
    make_cifar_like(tmp_path, "bad", n=300)
    shard = sorted((tmp_path / "bad" / "shards").glob("*.arrow"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with (
        run_server(tmp_path) as srv,
        Loader(srv.http_url, "bad", 32, rank=0, world_size=1, timeout=scaled(30.0)) as loader,
    ):
        start = time.monotonic()
        with pytest.raises(DatasetCorruptError, match=shard.name):
            for _ in loader:
                pass
        assert time.monotonic() - start < 15.0
