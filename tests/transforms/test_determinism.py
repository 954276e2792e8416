"""Server-side transforms give the same bytes for the same job: on two servers, with thread
or process pools of any size, across a kill -9 restart and across state_dict resumes; and
different bytes for different epochs."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from shardserve.client import Loader
from tests.support.resume import assert_resumes_exactly
from tests.support.server import free_port, run_server
from tests.support.slowness import scaled
from tests.transforms.conftest import CIFAR_CHAIN, MIXED_CHAIN, MODS, digest, pool_status

BATCH = 50


def _epoch(url: str, chain: list, epoch: int = 0, shuffle: bool = True, **kw: object) -> list[str]:
    with Loader(
        url,
        "cifar",
        batch_size=BATCH,
        seed=3,
        shuffle=shuffle,
        transforms=chain,
        timeout=scaled(30),
        **kw,
    ) as loader:
        loader.set_epoch(epoch)
        return [digest(b) for b in loader]


@pytest.mark.slow
def test_same_chain_same_bytes_on_two_servers(store: Path, no_leftovers: list[int]) -> None:
    """Two servers (one with 1 thread, one with 2 worker processes) serve byte-identical
    batches for the same job; epoch 1 differs from epoch 0 even in the same sample order."""
    with (
        run_server(store, *MODS, "--transform-pool", "thread", "--transform-workers", "1") as a,
        run_server(store, *MODS, "--transform-pool", "process", "--transform-workers", "2") as b,
    ):
        no_leftovers += [a.proc.pid, b.proc.pid]
        ref = _epoch(a.http_url, MIXED_CHAIN)
        assert len(ref) == 12 and len(set(ref)) == 12
        assert _epoch(b.http_url, MIXED_CHAIN) == ref
        assert pool_status(a.http_url)["pool"]["processes"] == 0
        status = pool_status(b.http_url)
        assert status["pool"]["processes"] == 2 and status["counts"]["samples"] == 600
        no_leftovers += status["pool"]["pids"]
        # Same order (no shuffle), other epoch: every batch's augmentation differs.
        e0 = _epoch(a.http_url, CIFAR_CHAIN, epoch=0, shuffle=False)
        e1 = _epoch(a.http_url, CIFAR_CHAIN, epoch=1, shuffle=False)
        assert all(x != y for x, y in zip(e0, e1, strict=True))
        assert _epoch(b.http_url, CIFAR_CHAIN, epoch=1, shuffle=False) == e1


@pytest.mark.slow
def test_same_bytes_across_kill9_restart(
    store: Path, tmp_path: Path, no_leftovers: list[int]
) -> None:
    """A Loader reading an epoch across a kill -9 of its server (process pool) gets exactly
    the batches of an uninterrupted run, byte for byte."""
    http, data = free_port(), free_port()
    args = (*MODS, "--transform-pool", "process", "--state-dir", str(tmp_path / "state"))
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(
            run_server(store, *args, http_port=http, data_port=data, workdir=tmp_path / "w")
        )
        ref = _epoch(srv.http_url, MIXED_CHAIN, epoch=2)
        got: list[str] = []
        # ipc, as tests/reliability/test_restart.py: a ring of a killed server is removed by
        # the next server only once no client maps it any more.
        with Loader(
            srv.http_url,
            "cifar",
            batch_size=BATCH,
            seed=3,
            transforms=MIXED_CHAIN,
            timeout=scaled(30),
            prefetch=2,
            transport="ipc",
        ) as loader:
            loader.set_epoch(2)
            for i, batch in enumerate(loader):
                got.append(digest(batch))
                if i == 4:
                    pids = pool_status(srv.http_url)["pool"]["pids"]
                    no_leftovers += [srv.proc.pid, *pids]
                    srv.kill()
                    srv = stack.enter_context(
                        run_server(
                            store, *args, http_port=http, data_port=data, workdir=tmp_path / "w"
                        )
                    )
            assert loader.stats().reconnects >= 1
        assert got == ref
        no_leftovers += [srv.proc.pid, *pool_status(srv.http_url)["pool"]["pids"]]


@pytest.mark.slow
def test_resume_from_state_dict_is_byte_identical(store: Path) -> None:
    """state_dict at batch 5 and load_state_dict in a new Loader yield the rest of the epoch
    byte for byte (assert_resumes_exactly)."""
    with run_server(store, *MODS) as srv:

        def make_iter(state: object) -> tuple:
            loader = Loader(
                srv.http_url,
                "cifar",
                batch_size=BATCH,
                seed=3,
                transforms=MIXED_CHAIN,
                timeout=scaled(30),
            )
            if state is not None:
                loader.load_state_dict(state)
            else:
                loader.set_epoch(1)
            return iter(loader), loader.state_dict

        assert_resumes_exactly(make_iter, midpoint=5, key=digest)
