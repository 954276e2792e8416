"""A slow or broken object store fails what needs it, by name, and nothing else: a shard
fetch from an endpoint that trickles bytes (moto behind a throttling proxy) fails with "store
unavailable" within its total deadline while a cached dataset on the same server streams
exactly; a tampered cache file is fetched again; a full cache disk says so."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from shardserve.client import Loader
from shardserve.proto.errors import DataStallError, ShardserveError
from shardserve.server.store.remote.object_fs import CacheUnwritable, StoreUnavailable
from shardserve.server.store.remote.stores import RemoteStore, StoreOptions
from tests.support.data import make_cifar_like
from tests.support.server import run_server
from tests.support.slowness import scaled

from .conftest import S3
from .test_s3_store import upload
from .throttle import ThrottlingProxy

TIMEOUT_S = 1.0
FLOOR = 64 << 10  # bytes/s: a 256 kB shard may take 3 x 1 s + 4 s


def _epoch(url: str, dataset: str, epoch: int, **kw: object) -> list[bytes]:
    with Loader(
        url, dataset, 64, seed=5, rank=0, world_size=1, timeout=scaled(30), shuffle="none", **kw
    ) as ld:
        ld.set_epoch(epoch)
        return [b["image"].numpy().tobytes() for b in ld]


@pytest.fixture(scope="module")
def local_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[bytes]], Path]:
    """``cached`` and ``slow`` on local disk, and ``cached``'s epochs 0 and 1 as a local server
    streams them; made once, as no test changes them: each uploads both to its own bucket."""
    root = tmp_path_factory.mktemp("local")
    make_cifar_like(root, name="cached", n=600, shard_bytes=256 << 10)
    make_cifar_like(root, name="slow", n=600, seed=7, shard_bytes=256 << 10)
    with run_server(root) as local:
        want = {f"cached{e}": _epoch(local.http_url, "cached", e) for e in (0, 1)}
    return want, root


def _two_datasets(s3: S3, local_two: tuple[dict[str, list[bytes]], Path]) -> dict[str, list[bytes]]:
    """Upload both datasets of ``local_two`` to ``s3``; the local server's bytes of ``cached``."""
    want, root = local_two
    for name in ("cached", "slow"):
        upload(s3, root, name)
    return want


@pytest.mark.slow
def test_trickling_endpoint_is_store_unavailable_beside_a_cached_dataset(
    s3: S3, tmp_path: Path, local_two: tuple[dict[str, list[bytes]], Path]
) -> None:
    """With the endpoint trickling 2 kB/s (every piece within the request timeout), a stream
    of the uncached dataset fails with 'unavailable' (never DataStallError) within its fetch
    deadline, while the cached dataset's next epoch arrives byte for byte."""
    want = _two_datasets(s3, local_two)
    with (
        ThrottlingProxy((s3.host, s3.port)) as proxy,
        run_server(
            s3.uri("store"),  # type: ignore[arg-type]
            "--cache-dir",
            str(tmp_path / "cache"),
            "--store-timeout-s",
            str(TIMEOUT_S),
            "--store-min-bytes-per-s",
            str(FLOOR),
            env={**s3.env, "AWS_ENDPOINT_URL": proxy.endpoint},
        ) as srv,
    ):
        assert _epoch(srv.http_url, "cached", 0) == want["cached0"]  # every shard now cached
        slow = Loader(
            srv.http_url,
            "slow",
            64,
            seed=5,
            rank=0,
            world_size=1,
            timeout=scaled(30),
            shuffle="none",
            prefetch=1,
        )
        proxy.throttle(2048)
        failure: list[BaseException] = []
        took: list[float] = []

        def read_slow() -> None:
            t0 = time.monotonic()
            try:
                slow.set_epoch(0)
                list(slow)
            except BaseException as e:
                failure.append(e)
            took.append(time.monotonic() - t0)

        t = threading.Thread(target=read_slow)
        t.start()
        assert _epoch(srv.http_url, "cached", 1) == want["cached1"]
        t.join(scaled(60))
        slow.close()
        assert not t.is_alive()
        assert len(failure) == 1, failure
        err = failure[0]
        assert isinstance(err, ShardserveError) and not isinstance(err, DataStallError), err
        text = str(err)
        assert "unavailable" in text and "s3://shards/store/slow" in text, text
        assert "bytes/s" in text, text
        # deadline 3 x 1 s + 256 kB at 64 kB/s, after a trickled manifest read; never the 30 s
        # stall timeout
        print(f"\ntrickling store: 'unavailable' after {took[0]:.1f} s: {text}")
        assert took[0] < 25, took
        proxy.unthrottle()
        r = httpx.get(f"{srv.http_url}/readyz", timeout=scaled(10))
        assert r.status_code == 200, r.text


def test_tampered_cache_file_is_fetched_again(
    s3: S3, tmp_path: Path, local_two: tuple[dict[str, list[bytes]], Path]
) -> None:
    """A cached shard whose bytes were changed on disk fails its checksum at first use, is
    removed and fetched again: the epoch is exact, and the log says what happened."""
    want = _two_datasets(s3, local_two)
    cache = tmp_path / "cache"
    args = ("--cache-dir", str(cache), "--store-timeout-s", "5")
    with run_server(s3.uri("store"), *args, env=s3.env) as srv:  # type: ignore[arg-type]
        assert _epoch(srv.http_url, "cached", 0) == want["cached0"]
    files = sorted(cache.glob("*.arrow"))
    assert files, "nothing was cached"
    for f in files:  # flip bytes in the middle of every cached shard
        data = bytearray(f.read_bytes())
        mid = len(data) // 2
        data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
        f.write_bytes(bytes(data))
    with run_server(s3.uri("store"), *args, env=s3.env) as srv:  # type: ignore[arg-type]
        assert _epoch(srv.http_url, "cached", 0) == want["cached0"]
        assert "failed its checksum; removed, to be fetched again" in srv.log_tail(1 << 20)


def test_full_cache_disk_is_reported_as_such(s3: S3, tmp_path: Path) -> None:
    """A fetch whose local file cannot take the bytes (/dev/full: ENOSPC from the kernel) is
    CacheUnwritable naming the shard, the folder and what to change, not 'store unavailable'."""
    root = tmp_path / "local"
    m = make_cifar_like(root, name="cached", n=300, shard_bytes=256 << 10)
    upload(s3, root, "cached")
    rs = RemoteStore(s3.uri("store"), StoreOptions.from_env(s3.env))
    info = rs.manifest("cached").shards[0]
    with pytest.raises(CacheUnwritable) as err:
        rs.fetch("cached", info, Path("/dev/full"))
    assert not isinstance(err.value, StoreUnavailable)
    text = str(err.value)
    assert "No space left on device" in text and info.path in text, text
    assert "--cache-limit-bytes" in text and m.name == "cached"


def test_sigterm_abandons_a_trickling_fetch_at_the_shutdown_deadline(
    s3: S3, tmp_path: Path, local_two: tuple[dict[str, list[bytes]], Path]
) -> None:
    """SIGTERM while a shard fetch trickles (its own deadline minutes away): the process is
    gone within --shutdown-timeout-s (plus slack for a loaded machine), with exit status 1
    and one log line naming the fetch it abandoned."""
    _two_datasets(s3, local_two)
    shutdown_s = 2.0
    with (
        ThrottlingProxy((s3.host, s3.port)) as proxy,
        run_server(
            s3.uri("store"),  # type: ignore[arg-type]
            "--cache-dir",
            str(tmp_path / "cache"),
            "--store-timeout-s",
            "60",
            "--store-min-bytes-per-s",
            "1",
            "--shutdown-timeout-s",
            str(shutdown_s),
            env={**s3.env, "AWS_ENDPOINT_URL": proxy.endpoint},
        ) as srv,
    ):
        # Only there to start a fetch: it gives up (a stall, the server gone) on its own.
        slow = Loader(
            srv.http_url,
            "slow",
            64,
            seed=5,
            rank=0,
            world_size=1,
            timeout=scaled(5.0),
            shuffle="none",
            prefetch=1,
        )
        proxy.throttle(16 << 10)  # a 256 kB shard would take 16 s
        ended = threading.Event()

        def read_slow() -> None:
            with contextlib.suppress(ShardserveError):
                slow.set_epoch(0)
                list(slow)
            ended.set()

        reader = threading.Thread(target=read_slow, daemon=True)
        reader.start()
        # Past the answers' headers: in the shard's bytes, where a read cannot be stopped.
        assert proxy.wait_trickled(8 << 10, scaled(30)), "no shard fetch reached the store"
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(timeout=shutdown_s + scaled(20))
        took = time.monotonic() - t0
        assert ended.wait(scaled(30)), "the Loader did not see the server go"
        slow.close()
        log = srv.log_tail(1 << 20)
    print(f"\nSIGTERM during a trickling fetch: exit {code} after {took:.1f} s")
    assert code == 1, log[-3000:]
    assert took < shutdown_s + scaled(3.0), (took, log[-3000:])
    abandoned = [line for line in log.splitlines() if "abandoned" in line]
    assert len(abandoned) == 1, log[-3000:]
    assert "s3://shards/store/slow/" in abandoned[0] and ".arrow" in abandoned[0], abandoned


def test_sigterm_while_the_server_starts_on_a_trickling_store_ends_it_in_time(
    s3: S3, tmp_path: Path, local_two: tuple[dict[str, list[bytes]], Path]
) -> None:
    """A server restarting with a journaled job reads that job's manifest as it starts; with
    the store trickling, a SIGTERM then (before the server listens) still ends it within
    --shutdown-timeout-s, exit status 1, one log line naming the read it abandoned."""
    _two_datasets(s3, local_two)
    shutdown_s = 2.0
    args = (
        "--cache-dir",
        str(tmp_path / "cache"),
        "--state-dir",
        str(tmp_path / "state"),
        "--store-timeout-s",
        "60",
        "--store-min-bytes-per-s",
        "1",
        "--shutdown-timeout-s",
        str(shutdown_s),
    )
    with ThrottlingProxy((s3.host, s3.port)) as proxy:
        env = {**os.environ, **s3.env, "AWS_ENDPOINT_URL": proxy.endpoint}
        with run_server(s3.uri("store"), *args, env=env) as srv:  # type: ignore[arg-type]
            r = httpx.post(
                f"{srv.http_url}/v1/jobs",
                json={"dataset": "slow", "batch_size": 64},
                timeout=scaled(30),
            )
            assert r.status_code in (200, 201), r.text
        proxy.throttle(256)  # a manifest of a few kB takes seconds
        log_path = tmp_path / "server.log"
        cmd = [
            sys.executable,
            "-m",
            "shardserve.server",
            "serve",
            "--store",
            s3.uri("store"),
            "--http",
            "127.0.0.1:0",
            "--data",
            "tcp://127.0.0.1:0",
            "--ipc",
            str(tmp_path / "ss.sock"),
            *args,
        ]
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            assert proxy.wait_trickled(512, scaled(30)), "the start read nothing from the store"
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=shutdown_s + scaled(20))
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=scaled(10))
    log = log_path.read_text(errors="replace")
    print(f"\nSIGTERM while starting on a trickling store: exit {code} after {took:.1f} s")
    assert "serve.ready" not in log, log[-3000:]  # the signal came while it started
    assert code == 1, log[-3000:]
    assert took < shutdown_s + scaled(3.0), (took, log[-3000:])
    abandoned = [line for line in log.splitlines() if "abandoned" in line]
    assert len(abandoned) == 1, log[-3000:]
    assert "reading s3://shards/store/slow/manifest.json" in abandoned[0], abandoned
