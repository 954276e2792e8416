"""Counters count batches, not messages: with small batches (several to a message) the
status page, ``GET /v1/jobs/{id}`` and ``/metrics`` all equal the loop's count."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shardserve.client import Loader
from tests.server.test_metrics import scrape, value
from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, job_status, run_server
from tests.support.slowness import scaled

N = 2000


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root: Path = tmp_path_factory.mktemp("counters")
    make_cifar_like(root, "cifar", n=N)
    with run_server(root) as s:
        yield s


def test_small_batches_are_counted_as_batches_everywhere(srv: ServerProc) -> None:
    """Two ranks of batch size 2 (many batches a message): each rank's batches_delivered,
    the status page's batches column and shardserve_job_batches_sent_total equal the batches
    its loop got; their sum equals shardserve_batches_sent_total; messages are fewer."""
    got = {}
    loaders = [
        Loader(srv.http_url, "cifar", 2, seed=1, rank=r, world_size=2, transport=t)
        for r, t in ((0, "socket"), (1, "auto"))
    ]
    try:
        for r, ld in enumerate(loaders):
            ld.set_epoch(0)
            got[r] = sum(1 for _ in ld)
            assert ld.stats().messages < got[r], "the batches did not travel several a message"
        job = loaders[0].job_id
        assert got == {0: N // 4, 1: N // 4}
        status = job_status(srv, job)
        by_rank = {r["rank"]: r["batches_delivered"] for r in status["ranks"]}
        assert by_rank == got
        _, samples = scrape(srv)
        for r, n in got.items():
            assert value(samples, "shardserve_job_batches_sent_total", job_id=job, rank=str(r)) == n
        total = value(samples, "shardserve_batches_sent_total")
        assert total == sum(got.values())
        messages = value(samples, "shardserve_messages_sent_total")
        assert 0 < messages < total
        page = httpx.get(f"{srv.http_url}/", timeout=scaled(10)).text
        for r, n in got.items():
            row = re.search(rf"<tr class='[^']*'><td>{r}</td>.*?</tr>", page, re.S)
            assert row is not None, page
            assert f"<td>{n}</td>" in row.group(0), row.group(0)
    finally:
        for ld in loaders:
            ld.close()
