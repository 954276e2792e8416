"""One job's transform that hangs on a thread fails that job alone, typed and in time: a job
beside it on another dataset gets exactly its batches, the transform moves to worker
processes afterwards, and SIGTERM stops the server within --shutdown-timeout-s."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shardserve.client import Loader
from shardserve.proto.errors import TransformError
from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled
from tests.transforms.conftest import MODS, digest, pool_status

TIMEOUT_S = 3.0
SHUTDOWN_S = 6.0
HFLIP = [{"name": "hflip", "params": {"layout": "CHW"}}]


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("iso")
    make_cifar_like(root, name="cifar", n=400, shard_bytes=256 << 10)
    make_cifar_like(root, name="other", n=600, seed=3, shard_bytes=256 << 10)
    return root


def _digests(url: str, dataset: str, chain: list, epochs: int = 1, **kw: object) -> list[str]:
    out = []
    with Loader(
        url, dataset, batch_size=20, seed=5, timeout=scaled(30), transforms=chain, **kw
    ) as ld:
        for epoch in range(epochs):
            ld.set_epoch(epoch)
            out += [digest(b) for b in ld]
    return out


@pytest.fixture(scope="module")
def expected(two_datasets: Path) -> list[str]:
    """The healthy job's batches on a server where nothing else runs."""
    with run_server(two_datasets, *MODS) as s:
        return _digests(s.http_url, "other", HFLIP, epochs=2)


@pytest.fixture
def srv(two_datasets: Path) -> Iterator[ServerProc]:
    with run_server(
        two_datasets,
        *MODS,
        "--transform-timeout-s",
        str(TIMEOUT_S),
        "--transform-workers",
        "2",
        "--transform-pool",
        "thread",
        "--shutdown-timeout-s",
        str(SHUTDOWN_S),
    ) as s:
        yield s


def test_hung_thread_fails_its_job_alone_and_sigterm_still_stops(
    srv: ServerProc, expected: list[str]
) -> None:
    """The hung job fails with TransformError within its deadline; the hflip job beside it
    (started beside it, and again after the hang) gets every batch exactly;
    the hung transform moves to processes; SIGTERM exits within the shutdown timeout."""
    hung: list[BaseException] = []
    took: list[float] = []

    def hang() -> None:
        t0 = time.monotonic()
        try:
            _digests(srv.http_url, "cifar", [{"name": "hang_thread"}])
        except BaseException as e:
            hung.append(e)
        took.append(time.monotonic() - t0)

    t = threading.Thread(target=hang)
    t.start()
    healthy = _digests(srv.http_url, "other", HFLIP, epochs=2)
    t.join(scaled(60))
    assert not t.is_alive(), "the hung job's Loader never returned"
    assert healthy == expected
    assert len(hung) == 1 and isinstance(hung[0], TransformError), hung
    assert "hang_thread" in str(hung[0]) and f"within {TIMEOUT_S} s" in str(hung[0])
    assert took[0] < TIMEOUT_S + 15, took
    st = pool_status(srv.http_url)["pool"]
    assert st["moved_to_processes"] == ["hang_thread"], st
    # Healthy again after the hang: a second run of the flip job is still exact.
    assert _digests(srv.http_url, "other", HFLIP, epochs=2) == expected
    r = httpx.get(f"{srv.http_url}/readyz", timeout=scaled(10))
    assert r.status_code == 200, r.text
    t0 = time.monotonic()
    code = srv.terminate(timeout=SHUTDOWN_S + 5)
    took = time.monotonic() - t0
    print(f"SIGTERM after the hang: exit {code} after {took:.2f} s")
    assert took < SHUTDOWN_S + 1, srv.log_tail()
    assert code == 0, (code, srv.log_tail())  # a clean stop: the watchdog was not needed


def test_a_hang_far_from_its_deadline_holds_no_thread_of_another_job(
    two_datasets: Path, expected: list[str]
) -> None:
    """While a thread transform hangs on both ranks of a job with its deadline 600 s away (so
    a batch of each rank waits that long: as many as the server has assembly threads), the
    hflip job on the other dataset streams every batch exactly (its client would raise
    DataStallError after 20 s); then SIGTERM still exits within --shutdown-timeout-s."""
    with run_server(
        two_datasets,
        *MODS,
        "--transform-timeout-s",
        "600",
        "--transform-pool",
        "thread",
        "--shutdown-timeout-s",
        "3",
    ) as s:

        def hang(rank: int) -> None:
            with contextlib.suppress(BaseException):
                _digests(s.http_url, "cifar", [{"name": "hang_thread"}], rank=rank, world_size=2)

        for rank in (0, 1):
            threading.Thread(target=hang, args=(rank,), daemon=True).start()
        deadline = time.monotonic() + scaled(30)
        while pool_status(s.http_url)["pool"]["running_on_assembly_threads"] < 2:  # hung
            assert time.monotonic() < deadline, s.log_tail()
            time.sleep(0.05)
        pool = pool_status(s.http_url)["pool"]
        assert pool["assembly_threads"] == 2, pool  # the hung job's lane, full; nobody else's
        with Loader(
            s.http_url, "other", batch_size=20, seed=5, timeout=scaled(20), transforms=HFLIP
        ) as ld:
            got = []
            for epoch in range(2):
                ld.set_epoch(epoch)
                got += [digest(b) for b in ld]
        assert got == expected
        t0 = time.monotonic()
        code = s.terminate(timeout=scaled(20))
        took = time.monotonic() - t0
        print(f"SIGTERM during a hung transform: exit {code} after {took:.2f} s")
        assert took < 3 + 2, s.log_tail()
