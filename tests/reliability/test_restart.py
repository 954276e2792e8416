"""Server restart mid-epoch: kill -9 twice, the epoch still arrives exactly once."""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from shardserve.client import Loader
from shardserve.server.planning import RankPlan, epoch_order
from shardserve.server.store.catalog import Store
from tests.reliability.conftest import CIFAR_N
from tests.support.data import sample_id_of
from tests.support.server import ServerProc, free_port, run_server
from tests.support.slowness import scaled

BATCH = 50
RESTARTS = 2


def _ids(batch: dict) -> list[int]:
    return sample_id_of({"image": batch["image"].numpy(), "label": batch["label"].numpy()}).tolist()


def _plan_ids(store: Path, seed: int, epoch: int, world_size: int, rank: int) -> list[int]:
    ds = Store(store).open("cifar")
    order = epoch_order(ds.num_samples, seed, epoch, "global", shard_rows=ds.shard_rows)
    plan = RankPlan.from_order(order, world_size, rank, BATCH, drop_last=False)
    return [int(i) for b in range(len(plan)) for i in plan.batch(b)]


class _Restarter:
    """A server on pinned ports and a pinned state/work dir that can be killed and started again."""

    def __init__(self, store: Path, tmp: Path) -> None:
        self.store, self.tmp = store, tmp
        self.http, self.data = free_port(), free_port()
        self.stack = contextlib.ExitStack()
        self.srv: ServerProc | None = None
        self.starts = 0

    def start(self) -> ServerProc:
        self.srv = self.stack.enter_context(
            run_server(
                self.store,
                "--state-dir",
                str(self.tmp / "state"),
                http_port=self.http,
                data_port=self.data,
                workdir=self.tmp / "work",
            )
        )
        self.starts += 1
        return self.srv

    def crash_and_restart(self) -> None:
        assert self.srv is not None
        self.srv.kill()  # SIGKILL: no goodbye to the streams, no flush
        self.start()

    def __enter__(self) -> _Restarter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_single_rank_epoch_survives_two_kill9_restarts(
    rel_store: Path, tmp_path: Path, transport: str
) -> None:
    """A Loader reading an epoch across two kill -9 restarts on the same ports gets exactly its plan: every sample once, in order."""
    with _Restarter(rel_store, tmp_path) as r:
        srv = r.start()
        loader = Loader(
            srv.http_url,
            "cifar",
            batch_size=BATCH,
            seed=4,
            prefetch=2,
            timeout=scaled(20.0),
            transport=transport,
        )
        with loader:
            n_batches = len(loader)
            cut = {
                n_batches // 3,
                2 * n_batches // 3,
            }  # 12 batches: 4 left after each crash, > prefetch
            seen: list[int] = []
            loader.set_epoch(1)
            for i, batch in enumerate(loader):
                seen += _ids(batch)
                if i + 1 in cut:
                    r.crash_and_restart()
            reconnects = loader.stats().reconnects
        counts = Counter(seen)
        twice = sorted(k for k, c in counts.items() if c > 1)
        missing = sorted(set(range(CIFAR_N)) - set(counts))
        assert not twice and not missing, f"twice: {twice[:10]}, missing: {missing[:10]}"
        assert seen == _plan_ids(rel_store, seed=4, epoch=1, world_size=1, rank=0)
        assert r.starts == RESTARTS + 1 and reconnects >= RESTARTS


def test_two_ranks_survive_two_kill9_restarts(rel_store: Path, tmp_path: Path) -> None:
    """Two ranks (world_size=2) in one process across two kill -9 restarts: each rank gets exactly its plan, together every sample."""
    with _Restarter(rel_store, tmp_path) as r:
        srv = r.start()
        loaders = [
            Loader(
                srv.http_url,
                "cifar",
                batch_size=BATCH,
                seed=9,
                rank=k,
                world_size=2,
                prefetch=1,
                timeout=scaled(20.0),
            )
            for k in range(2)
        ]
        try:
            n_batches = len(loaders[0])
            # Each crash leaves more batches to read than are prefetched: both ranks must reconnect.
            cut = {1, 3}
            assert n_batches >= 5
            seen: list[list[int]] = [[], []]
            for ld in loaders:
                ld.set_epoch(2)
            its = [iter(ld) for ld in loaders]
            for i in range(n_batches):
                for k, it in enumerate(its):
                    seen[k] += _ids(next(it))
                if i + 1 in cut:
                    r.crash_and_restart()
            for it in its:
                assert next(it, None) is None  # the epoch ends where the plan says
            assert all(ld.stats().reconnects >= RESTARTS for ld in loaders)
        finally:
            for ld in loaders:
                ld.close()
        for k in range(2):
            assert seen[k] == _plan_ids(rel_store, seed=9, epoch=2, world_size=2, rank=k), k
            assert len(set(seen[k])) == len(seen[k]) == CIFAR_N // 2, f"rank {k} got a sample twice"
        union = np.unique(np.concatenate([np.array(s) for s in seen]))
        assert np.array_equal(union, np.arange(CIFAR_N))
