"""Joining and resuming a shared pass (``Loader(share=...)``): a late joiner gets the whole epoch
(shared inside the window, on its own pass outside it) and a resumed subscriber exactly the rest,
byte-equal to an unshared Loader. Real server, real Loaders (threads of this process)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shardserve.client import Loader
from tests.dataplane.sharing import (
    Subscriber,
    assert_exact,
    counters,
    group_with,
    kwargs,
    opened,
    record,
    unshared_epoch,
    write_store,
)
from tests.support.resume import assert_resumes_exactly
from tests.support.server import ServerProc, run_server


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_store(tmp_path_factory.mktemp("share"))


@pytest.fixture(scope="module")
def srv(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """The default window (64 batches): an epoch of 30 batches of 64 is never detached."""
    with run_server(store, "--state-dir", str(tmp_path_factory.mktemp("state"))) as s:
        yield s


@pytest.fixture(scope="module")
def narrow(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """A window of 4 batches (prefetch 4: 2 batches a message, so the window stays 4)."""
    state = str(tmp_path_factory.mktemp("state"))
    with run_server(store, "--share-window", "4", "--state-dir", state) as s:
        yield s


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_a_late_joiner_gets_the_whole_epoch(
    srv: ServerProc, narrow: ServerProc, where: str
) -> None:
    """A subscriber that joins after two others read part of the epoch gets all of it,
    byte-exact: inside the window (64 batches, the epoch is 30) it is shared, so the epoch is
    still assembled once; outside it (4 batches, 20 read of 60) it runs on its own pass,
    assembled for it."""
    inside = where == "inside"
    server, size, stop, prefetch = (srv, 64, 8, 8) if inside else (narrow, 32, 20, 4)
    kw = kwargs(400 + (not inside), prefetch=prefetch, share=f"late-{where}")
    want = unshared_epoch(server, size, kw)
    before = counters(server)
    gate = threading.Event()
    with opened(gate):
        first = [
            Subscriber(server, size, kw, f"subscriber {i}", stop_at=stop, gate=gate)
            for i in range(2)
        ]
        for s in first:
            s.wait_reached()
        late = Subscriber(server, size, kw, "late joiner", stop_at=1, gate=gate)
        late.wait_reached()
        if inside:
            group_with(server, str(late.job_id), 3)
        gate.set()
        for s in (*first, late):
            assert_exact(s.name, s.result(), want)
    assembled = (
        counters(server)["shardserve_batches_assembled_total"]
        - before["shardserve_batches_assembled_total"]
    )
    assert late.stats is not None
    if inside:
        assert (assembled, late.stats.detached) == (len(want), 0), late.stats
    else:
        assert assembled > len(want), f"assembled {assembled} for a plan of {len(want)}"


@pytest.mark.parametrize("midpoint", [8, 7], ids=["span-boundary", "mid-span"])
def test_a_resumed_subscriber_gets_exactly_the_rest(srv: ServerProc, midpoint: int) -> None:
    """A subscriber takes ``midpoint`` batches, saves its state_dict and closes while another
    subscriber waits at batch 12; a new Loader of the share that loads the state gets exactly
    the rest of the epoch (at a boundary of the group's 4-batch messages or inside one), and
    the other subscriber its whole epoch."""
    kw = kwargs(500 + midpoint, share=f"resume-{midpoint}")
    want = unshared_epoch(srv, 64, kw)
    gate = threading.Event()
    with opened(gate):
        other = Subscriber(srv, 64, kw, "other subscriber", stop_at=12, gate=gate)
        other.wait_reached()
        with Loader(srv.http_url, "cifar", 64, **kw) as first:
            first.set_epoch(0)
            it = iter(first)
            head = [record(next(it)) for _ in range(midpoint)]
            state = json.loads(json.dumps(first.state_dict()))
            del it
        with Loader(srv.http_url, "cifar", 64, **kw) as resumed:
            resumed.load_state_dict(state)
            gate.set()
            rest = [record(b) for b in resumed]
        assert_exact("the resumed subscriber", head + rest, want)
        assert_exact(other.name, other.result(), want)


def test_a_lone_subscriber_resumes_exactly(srv: ServerProc) -> None:
    """A shared Loader with no other subscriber passes the resume check every resumable
    thing passes."""
    kw = kwargs(600, share="lone")
    loaders: list[Loader] = []

    def make_iter(state: Any) -> tuple[Iterator[Any], Callable[[], Any]]:
        loader = Loader(srv.http_url, "cifar", 64, **kw)
        loaders.append(loader)
        if state is None:
            loader.set_epoch(0)
        else:
            loader.load_state_dict(state)
        return iter(loader), loader.state_dict

    try:
        assert_resumes_exactly(make_iter, midpoint=11, key=record)
    finally:
        for loader in loaders:
            loader.close()
