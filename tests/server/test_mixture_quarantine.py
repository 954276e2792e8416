"""Quarantine over the control plane of a real server: quarantined ids leave a mixture job's plan
from its frontier on, a duplicate post holds nothing more, the bound counts distinct ids, a
restart gives back the same set, and posts keep one mixture order per epoch in the plan cache."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from shardserve.proto.errors import BadRequest
from shardserve.server.planning.mixture import split_ids
from tests.server.mixing import (
    OFFSETS,
    SIZES,
    SPEC,
    WORLD,
    global_order,
    plan,
    post_job,
    quarantine,
    write_mix_store,
)
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled


@pytest.fixture(scope="module")
def mix_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mix_store(tmp_path_factory.mktemp("mixstore"))


@pytest.fixture()
def srv(mix_store: Path, tmp_path: Path) -> Iterator[ServerProc]:
    with run_server(mix_store, "--state-dir", str(tmp_path / "state")) as s:
        yield s


def test_quarantine_drops_ids_from_the_frontier_on(srv: ServerProc) -> None:
    """Quarantined ids of a source never appear in the plan from the job's frontier (step 0
    here: no rank streamed yet); the list says which ids, why, and from which step."""
    job = post_job(srv, SPEC).json()["id"]
    before = global_order([plan(srv, job, r) for r in range(WORLD)])
    src, ids = split_ids(before, OFFSETS)
    bad = sorted(set(ids[src == 1][:25].tolist()))
    r = httpx.post(
        f"{srv.http_url}/v1/datasets/code/quarantine",
        json={"ids": bad, "reason": "mislabelled"},
        headers=srv.headers,
        timeout=scaled(10),
    )
    assert r.status_code == 200, r.text
    assert r.json()["entries"] == [{"ids": bad, "reason": "mislabelled", "at": {job: 0}}]
    after = global_order([plan(srv, job, r) for r in range(WORLD)])
    src2, ids2 = split_ids(after, OFFSETS)
    assert not np.isin(ids2[src2 == 1], bad).any()
    assert np.array_equal(src, src2)  # the same positions draw the same sources
    r = httpx.post(
        f"{srv.http_url}/v1/datasets/code/quarantine",
        json={"ids": [SIZES["code"]], "reason": "x"},
        headers=srv.headers,
        timeout=scaled(10),
    )
    assert r.status_code == 422 and "0 <= id < 4000" in r.text
    listed = httpx.get(
        f"{srv.http_url}/v1/datasets/code/quarantine", headers=srv.headers, timeout=scaled(10)
    )
    assert listed.json()["total_ids"] == len(bad)


def test_quarantine_is_a_set_a_duplicate_holds_nothing_more(
    mix_store: Path, tmp_path: Path
) -> None:
    """The same id posted again is the same entry: the count of distinct ids, the entries, the
    bytes the server holds for them and the journal stay as after the first post; a new reason
    replaces the old one (journaled once); a reason over the limit is a 422 naming it; a
    restart gives back the same set, with each id's first step and latest reason."""
    state = tmp_path / "state"
    journal = state / "jobs.jsonl"
    with run_server(mix_store, "--state-dir", str(state)) as a:
        job = post_job(a, SPEC).json()["id"]
        first = quarantine(a, "code", [7], "blurry")
        assert first.status_code == 200, first.text
        held, lines = first.json()["held_bytes"], journal.read_text().count("\n")
        assert held > 0
        for _ in range(300):
            r = quarantine(a, "code", [7], "blurry")
            assert r.status_code == 200, r.text
        got = r.json()
        assert got["total_ids"] == 1 and got["held_bytes"] == held
        assert got["entries"] == [{"ids": [7], "reason": "blurry", "at": {job: 0}}]
        assert journal.read_text().count("\n") == lines  # nothing journaled per duplicate
        assert (
            'shardserve_quarantined_samples{dataset="code"} 1.0'
            in httpx.get(f"{a.http_url}/metrics", headers=a.headers, timeout=scaled(10)).text
        )
        for _ in range(50):
            r = quarantine(a, "code", [7, 8], "mislabelled")
        assert r.json()["total_ids"] == 2
        assert r.json()["entries"] == [{"ids": [7, 8], "reason": "mislabelled", "at": {job: 0}}]
        assert journal.read_text().count("\n") == lines + 1
        long = quarantine(a, "code", [9], "x" * 513)
        assert long.status_code == 422 and "512" in long.text and "reason" in long.text
        plan_before = [plan(a, job, r) for r in range(WORLD)]
        a.kill()  # kill -9: the journal is all that is left
        a.proc.wait(timeout=scaled(30))
    with run_server(mix_store, "--state-dir", str(state)) as b:
        listed = httpx.get(
            f"{b.http_url}/v1/datasets/code/quarantine", headers=b.headers, timeout=scaled(10)
        )
        assert listed.json()["entries"] == r.json()["entries"]
        assert [plan(b, job, r).tobytes() for r in range(WORLD)] == [
            p.tobytes() for p in plan_before
        ]


def test_quarantine_bound_counts_distinct_ids() -> None:
    """The bound on quarantined ids counts each id once, however often it is posted."""
    from shardserve.server.registry.quarantine import Quarantines

    q = Quarantines(max_ids=3)
    for _ in range(5):
        q.add("web", [1, 2, 3], "bad", {})
    assert q.count("web") == 3
    with pytest.raises(BadRequest, match="limit of 3"):
        q.add("web", [4], "bad", {})


def test_quarantine_posts_keep_one_mixture_order_per_epoch(srv: ServerProc) -> None:
    """Each post that adds ids makes the job's plans again; the orders made before it are
    never asked for again, so the plan cache holds one order for the epoch, not one a post."""
    job = post_job(srv, SPEC).json()["id"]

    def cached() -> float:
        text = httpx.get(f"{srv.http_url}/metrics", headers=srv.headers, timeout=scaled(10)).text
        return float(re.search(r"^shardserve_plan_cache_bytes (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]

    plan(srv, job, 0)
    one = cached()
    assert one > 0
    for i in range(20):
        assert quarantine(srv, "code", [i], "bad").status_code == 200
        plan(srv, job, 0)
    assert cached() == one
