"""A store in an S3 bucket (moto on loopback, pyarrow's S3 client): ingest, CLI, serving
through the local shard cache, corruption, an endpoint that goes away, and no leaked secrets."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from shardserve.client import Loader
from shardserve.proto.errors import DatasetCorruptError, ShardserveError
from shardserve.proto.manifest import Manifest
from shardserve.server.store.catalog import Store
from shardserve.server.store.remote.publish import RemotePublisher
from shardserve.server.store.remote.stores import RemoteStore, StoreOptions
from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

from .conftest import ACCESS_KEY, S3, SECRET_KEY

N = 1200  # cifar-like samples of ~3 KiB: 1 MiB shards make 4 of them, 256 KiB ones 15


@pytest.fixture(scope="module")
def local_cifar(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    """``cifar`` (N samples in 256 KiB shards) on local disk; read-only: each test uploads it
    to its own fresh bucket."""
    root = tmp_path_factory.mktemp("local")
    return root, make_cifar_like(root, n=N, shard_bytes=256 << 10)


@pytest.fixture(scope="module")
def local_server(local_cifar: tuple[Path, Manifest]) -> Iterator[ServerProc]:
    """A server on ``local_cifar`` giving the reference bytes: shared, as a job's batches
    depend on its arguments alone and nothing here changes the store or a job."""
    with run_server(local_cifar[0]) as srv:
        yield srv


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "shardserve.server", *args],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        env={**os.environ, **env},
    )


def upload(s3: S3, local_root: Path, name: str, prefix: str = "store") -> RemoteStore:
    rs = RemoteStore(s3.uri(prefix), StoreOptions.from_env(s3.env))
    RemotePublisher(rs).upload(local_root / name, name, overwrite=False)
    return rs


def epoch_bytes(url: str, epoch: int, **kw: object) -> list[bytes]:
    """Every batch of one epoch of rank 0 of 1, as raw image bytes."""
    with Loader(url, "cifar", 64, seed=5, rank=0, world_size=1, timeout=scaled(30), **kw) as loader:
        loader.set_epoch(epoch)
        return [b["image"].numpy().tobytes() for b in loader]


def metric(srv_url: str, name: str) -> float:
    text = httpx.get(f"{srv_url}/metrics", timeout=scaled(10)).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} not in /metrics")


def test_cli_ingests_to_a_bucket_and_reads_it_back(s3: S3, tmp_path: Path) -> None:
    """`ingest --store s3://...` publishes a dataset that `ls`, `inspect` and `verify` read,
    with the same samples as a local ingest of the same source."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        np.savez(
            src / f"part{i}.npz",
            x=rng.standard_normal((50, 4)).astype(np.float32),
            y=np.arange(i * 50, i * 50 + 50),
        )
    uri = s3.uri("cli")
    r = cli(
        "ingest",
        str(src),
        "--store",
        uri,
        "--name",
        "tbl",
        "--quiet",
        "--shard-size",
        "2KiB",
        env=s3.env,
    )
    assert r.returncode == 0, r.stderr
    assert "ingested tbl: 150 samples" in r.stdout
    r = cli("ls", "--store", uri, env=s3.env)
    assert r.returncode == 0 and "tbl" in r.stdout, r.stderr
    r = cli("inspect", "--store", uri, "tbl", env=s3.env)
    assert r.returncode == 0 and "samples   150" in r.stdout, r.stderr
    r = cli("verify", "--store", uri, "tbl", "--quiet", env=s3.env)
    assert r.returncode == 0 and "shards ok" in r.stdout, r.stderr
    # again without --overwrite: refused, the first dataset untouched
    r = cli("ingest", str(src), "--store", uri, "--name", "tbl", "--quiet", env=s3.env)
    assert r.returncode == 2 and "--overwrite" in r.stderr

    local = tmp_path / "local"
    r = cli(
        "ingest",
        str(src),
        "--store",
        str(local),
        "--name",
        "tbl",
        "--quiet",
        "--shard-size",
        "2KiB",
        env={},
    )
    assert r.returncode == 0, r.stderr
    rs = RemoteStore(uri, StoreOptions.from_env(s3.env))
    from shardserve.server.store.cache import ShardCache

    rs.cache = ShardCache(tmp_path / "cache", 1 << 20)
    a, b = rs.open("tbl"), Store(local).open("tbl")
    idx = np.arange(150)
    for k, v in b.take(idx).items():
        assert np.array_equal(a.take(idx)[k], v), k
    a.close()
    b.close()


def test_cache_smaller_than_the_dataset_serves_identical_bytes(
    s3: S3, tmp_path: Path, local_cifar: tuple[Path, Manifest], local_server: ServerProc
) -> None:
    """Served from the bucket through a cache of a third of the dataset, every epoch's bytes
    equal the local store's, shards are evicted while an epoch streams, and /metrics counts
    hits, misses and fetched bytes."""
    root, m = local_cifar
    upload(s3, root, "cifar")
    limit = m.total_bytes // 3
    want = {e: epoch_bytes(local_server.http_url, e, shuffle="block") for e in (0, 1)}
    with run_server(
        s3.uri("store"),  # type: ignore[arg-type]
        "--cache-dir",
        str(tmp_path / "cache"),
        "--cache-limit-bytes",
        str(limit),
        env=s3.env,
    ) as srv:
        for e in (0, 1):
            # A window of 4 batches: the default credit (about 8 MiB) would hold this whole
            # 3.6 MB dataset in flight, every shard leased, none evictable.
            assert epoch_bytes(srv.http_url, e, shuffle="block", prefetch=4) == want[e]
        assert metric(srv.http_url, "shardserve_cache_misses_total") >= len(m.shards)
        assert metric(srv.http_url, "shardserve_cache_evictions_total") > 0
        assert metric(srv.http_url, "shardserve_cache_hits_total") > 0
        # the block plan's next shards were fetched ahead of the reader
        assert metric(srv.http_url, "shardserve_cache_prefetches_total") > 0
        fetched = metric(srv.http_url, "shardserve_cache_fetched_bytes_total")
        assert fetched >= m.total_bytes
        page = httpx.get(f"{srv.http_url}/", timeout=scaled(10)).text
        assert "shard cache" in page and "hit rate" in page
    cached = sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.arrow"))
    assert cached <= limit + 2 * max(s.bytes for s in m.shards)


def test_warm_cache_needs_no_fetch_and_a_global_shuffle_matches(s3: S3, tmp_path: Path) -> None:
    """With a cache as big as the dataset, a second epoch fetches nothing; a global shuffle
    (which touches every shard per batch) also gives the local store's bytes."""
    root = tmp_path / "local"
    make_cifar_like(root, n=N, shard_bytes=1 << 20)
    upload(s3, root, "cifar")
    with run_server(root) as local:
        want = epoch_bytes(local.http_url, 0)
    with run_server(
        s3.uri("store"),  # type: ignore[arg-type]
        "--cache-dir",
        str(tmp_path / "cache"),
        env=s3.env,
    ) as srv:
        assert epoch_bytes(srv.http_url, 0) == want
        fetched = metric(srv.http_url, "shardserve_cache_fetches_total")
        assert epoch_bytes(srv.http_url, 0) == want
        assert metric(srv.http_url, "shardserve_cache_fetches_total") == fetched


def test_a_shard_corrupted_in_the_bucket_fails_loudly_with_its_name(s3: S3, tmp_path: Path) -> None:
    """A shard whose bytes in the bucket differ from the manifest's checksum raises
    DatasetCorruptError naming that shard, and the cache never publishes it."""
    root = tmp_path / "local"
    m = make_cifar_like(root, n=N, shard_bytes=1 << 20)
    rs = upload(s3, root, "cifar")
    bad = rs.manifest("cifar").shards[1]
    fs = s3.filesystem()
    key = f"shards/store/cifar/{bad.path}"
    with fs.open_input_stream(key) as f:  # type: ignore[attr-defined]
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF
    with fs.open_output_stream(key) as f:  # type: ignore[attr-defined]
        f.write(bytes(data))
    cache = tmp_path / "cache"
    with run_server(s3.uri("store"), "--cache-dir", str(cache), env=s3.env) as srv:  # type: ignore[arg-type]
        with pytest.raises(DatasetCorruptError) as info:
            epoch_bytes(srv.http_url, 0, shuffle="none")
        assert bad.path in str(info.value) and "checksum" in str(info.value)
    assert not list(cache.glob(bad.checksum.replace(":", "-") + "*"))
    assert len(m.shards) > 1


@pytest.mark.parametrize("how", ["stopped", "hung"])
def test_endpoint_going_away_mid_epoch_errors_then_recovers(
    s3: S3,
    tmp_path: Path,
    local_cifar: tuple[Path, Manifest],
    local_server: ServerProc,
    how: str,
) -> None:
    """When the S3 endpoint stops (connections refused) or hangs (accepts, never answers)
    mid-epoch, the loop gets a clear error naming the store within its deadline; once the
    endpoint is back, a resumed loop gives exactly the rest."""
    import contextlib
    import socket

    root, m = local_cifar
    upload(s3, root, "cifar")
    want = epoch_bytes(local_server.http_url, 0, shuffle="none")
    smallest = max(s.bytes for s in m.shards)
    with (
        contextlib.ExitStack() as stack,
        run_server(
            s3.uri("store"),  # type: ignore[arg-type]
            "--cache-dir",
            str(tmp_path / "cache"),
            "--cache-limit-bytes",
            str(2 * smallest),
            "--store-timeout-s",
            "1",
            env=s3.env,
        ) as srv,
    ):
        got: list[bytes] = []
        black_hole = socket.socket()
        stack.callback(black_hole.close)  # also when an assertion below fails
        loader = Loader(
            srv.http_url,
            "cifar",
            64,
            seed=5,
            rank=0,
            world_size=1,
            timeout=scaled(20),
            shuffle="none",
            prefetch=1,
        )
        state = loader.state_dict()
        started = time.monotonic()
        with pytest.raises(ShardserveError) as info:
            for i, b in enumerate(loader):
                got.append(b["image"].numpy().tobytes())
                state = loader.state_dict()
                if i == 3:
                    s3.stop()
                    if how == "hung":  # the port accepts connections that never get an answer
                        black_hole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                        black_hole.bind((s3.host, s3.port))
                        black_hole.listen(64)
                    started = time.monotonic()
        waited = time.monotonic() - started
        assert "unavailable" in str(info.value) and "s3://shards/store" in str(info.value)
        assert waited < 20, f"the error took {waited:.1f} s"
        assert 4 <= len(got) < len(want)
        black_hole.close()
        s3.start()
        loader.load_state_dict(state)
        got += [b["image"].numpy().tobytes() for b in loader]
        loader.close()
        assert got == want
        log = srv.log_tail(1 << 20)
    assert SECRET_KEY not in log and ACCESS_KEY not in log


@pytest.mark.slow
def test_credentials_never_appear_in_logs_errors_metrics_or_pages(s3: S3, tmp_path: Path) -> None:
    """The access key and secret appear nowhere a user or scraper can read: server log,
    /metrics, the status page, /v1/info, CLI output and errors, even with the store away."""
    root = tmp_path / "local"
    make_cifar_like(root, n=300, shard_bytes=256 << 10)
    upload(s3, root, "cifar")
    # credentials in the URI too: they must be cut from what is shown
    uri_with_creds = f"s3://{ACCESS_KEY}:{SECRET_KEY}@shards/store?endpoint_override=127.0.0.1:{s3.port}&scheme=http"
    seen: list[str] = []
    with run_server(
        s3.uri("store"),
        "--cache-dir",
        str(tmp_path / "cache"),  # type: ignore[arg-type]
        "--log-level",
        "debug",
        env=s3.env,
    ) as srv:
        epoch_bytes(srv.http_url, 0)
        for path in ("/metrics", "/", "/v1/info", "/v1/datasets", "/v1/jobs"):
            seen.append(httpx.get(f"{srv.http_url}{path}", timeout=scaled(10)).text)
        s3.stop()
        with pytest.raises(ShardserveError) as info:
            epoch_bytes(srv.http_url, 1, shuffle="none", prefetch=1)
        seen.append(str(info.value))
        page = httpx.get(f"{srv.http_url}/", timeout=scaled(10))
        assert page.status_code == 200 and "unavailable" in page.text  # the page still renders
        listing = httpx.get(f"{srv.http_url}/v1/datasets", timeout=scaled(10))
        assert listing.status_code == 503, listing.text
        seen += [page.text, listing.text]
        seen.append(srv.log_tail(1 << 22))
    for args in (
        ("ls", "--store", s3.uri("store")),
        ("ls", "--store", uri_with_creds),
        ("verify", "--store", uri_with_creds, "cifar"),
    ):
        r = cli(*args, env=s3.env)
        assert r.returncode != 0  # the endpoint is down
        seen += [r.stdout, r.stderr]
    s3.start()
    r = cli("ls", "--store", uri_with_creds, env=s3.env)
    assert r.returncode == 0, r.stderr
    seen += [r.stdout, r.stderr]
    for text in seen:
        assert SECRET_KEY not in text and ACCESS_KEY not in text, text[-2000:]
    assert any("unavailable" in t for t in seen)


def test_two_servers_sharing_one_cache_dir_serve_identical_bytes(
    s3: S3, tmp_path: Path, local_cifar: tuple[Path, Manifest], local_server: ServerProc
) -> None:
    """Two server processes on one host, one cache folder smaller than the dataset, streaming
    at the same time: both give the local store's bytes, and every cached file verifies."""
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    root, m = local_cifar
    upload(s3, root, "cifar")
    want = epoch_bytes(local_server.http_url, 0, shuffle="block")
    cache = tmp_path / "cache"
    args = ("--cache-dir", str(cache), "--cache-limit-bytes", str(m.total_bytes // 2))
    with (
        run_server(s3.uri("store"), *args, "--state-dir", str(tmp_path / "a"), env=s3.env) as a,  # type: ignore[arg-type]
        run_server(s3.uri("store"), *args, "--state-dir", str(tmp_path / "b"), env=s3.env) as b,  # type: ignore[arg-type]
        ThreadPoolExecutor(2) as pool,
    ):
        runs = [pool.submit(epoch_bytes, srv.http_url, 0, shuffle="block") for srv in (a, b)]
        assert [r.result(timeout=scaled(120)) for r in runs] == [want, want]
    files = list(cache.glob("*.arrow"))
    assert files
    for f in files:
        assert f.name.split("-", 1)[1] == xxhash.xxh3_64(f.read_bytes()).hexdigest() + ".arrow"
    assert not list(cache.glob(".tmp-*"))


def test_nested_nullable_and_variable_fields_read_the_same_from_a_bucket(
    s3: S3, tmp_path: Path
) -> None:
    """The read matrix's hardest case once through S3 (moto): masks, the values behind them and
    variable-size members equal the local store's, batch for batch."""
    import torch

    from shardserve.client import Masked
    from shardserve.server.store.ingest.run import ingest
    from tests.store.test_read_matrix import assert_same_batch

    src = tmp_path / "src"
    src.mkdir()
    for i in range(60):
        p = None if i % 3 == 0 else {"nu": torch.full((2,), i + 0.5)}
        sample = {"a": torch.arange(3.0) + i, "p": p, "tok": torch.arange(i % 4 + 1)}
        torch.save(sample, src / f"{i:04d}.pt")
    root = tmp_path / "local"
    ingest(src, root, "pde", shard_bytes=1 << 10, progress=False)
    upload(s3, root, "pde")

    def read(url: str) -> list[dict[str, object]]:
        with Loader(url, "pde", 7, seed=3, rank=0, world_size=1, timeout=scaled(60)) as loader:
            loader.set_epoch(1)
            return list(loader)

    with run_server(root) as local:
        want = read(local.http_url)
    cache = str(tmp_path / "cache")
    with run_server(s3.uri("store"), "--cache-dir", cache, env=s3.env) as srv:  # type: ignore[arg-type]
        got = read(srv.http_url)
    assert len(got) == len(want) > 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same_batch(g, w, f"batch {i}")
    assert any(isinstance(b["p"], dict) and isinstance(b["p"]["nu"], Masked) for b in want)
