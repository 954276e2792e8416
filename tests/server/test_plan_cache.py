"""The epoch orders a server keeps are bounded in bytes (``--plan-cache-bytes``), by what it
counts (``shardserve_plan_cache_bytes``): a flood of ``GET .../plan`` for other epochs keeps
no more, and an order dropped is made again, the same."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.server.conftest import CIFAR_N
from tests.support.server import ServerProc, make_job, run_server
from tests.support.slowness import scaled

BOUND = 16 * 4 * CIFAR_N  # sixteen orders of 4 bytes a sample


def plan_bytes(srv: ServerProc) -> float:
    text = httpx.get(f"{srv.http_url}/metrics", headers=srv.headers, timeout=scaled(10)).text
    m = re.search(r"^shardserve_plan_cache_bytes (\S+)$", text, re.MULTILINE)
    assert m is not None, "no shardserve_plan_cache_bytes in /metrics"
    return float(m.group(1))


def get_plan(srv: ServerProc, job: str, epoch: int) -> bytes:
    r = httpx.get(
        f"{srv.http_url}/v1/jobs/{job}/plan",
        params={"epoch": epoch},
        headers=srv.headers,
        timeout=scaled(30),
    )
    assert r.status_code == 200, r.text
    return r.content


def test_a_flood_of_plans_keeps_at_most_the_bound(cifar_store: Path) -> None:
    with run_server(cifar_store, "--plan-cache-bytes", str(BOUND)) as srv:
        job = make_job(srv, batch_size=10, seed=5)
        first = get_plan(srv, job, 0)
        one = plan_bytes(srv)
        assert 0 < one <= BOUND
        for epoch in range(1, 60):
            get_plan(srv, job, epoch)
        held = plan_bytes(srv)
        assert BOUND - one < held <= BOUND  # full, and no more
        assert get_plan(srv, job, 0) == first  # dropped long ago: made again, the same
