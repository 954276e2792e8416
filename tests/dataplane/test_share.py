"""Shared passes (``Loader(share=...)``): subscribers of one rank's pass get exactly the bytes of
an unshared Loader of the same arguments, the server assembles each batch once for all of them,
a subscriber that falls behind the window is detached without stalling the others, one killed
with SIGKILL stops nobody, and past the server's share budget nothing
is kept. Late joiners and resumed subscribers: ``test_share_joins.py``. Real server, real
Loaders (threads of this process, and one subprocess)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.dataplane.sharing import (
    CROP_FLIP,
    ROOT,
    WAIT_S,
    Subscriber,
    assert_exact,
    counter,
    counters,
    group_with,
    kwargs,
    opened,
    unshared_epoch,
    wait_until,
    write_store,
)
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled


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


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("chain", [None, CROP_FLIP], ids=["stored", "crop-flip"])
def test_three_subscribers_get_unshared_bytes_assembled_once(
    srv: ServerProc, transport: str, chain: list[dict[str, Any]] | None
) -> None:
    """Three concurrent subscribers each get every batch of the epoch once, in plan order,
    byte-equal to an unshared Loader's (transformed ones too); the server assembles the epoch's
    batches once (1x the plan) and sends them three times."""
    seed = 100 + 10 * (transport == "tcp") + (chain is not None)
    kw = kwargs(seed, transport=transport, transforms=chain, share=f"three-{transport}-{seed}")
    want = unshared_epoch(srv, 64, kw)
    if chain is not None:
        dtypes = {field: dtype for field, dtype, _, _ in want[0][0]}
        assert dtypes["image"] == "torch.float32", f"the transform chain did not run: {dtypes}"
    batches = len(want)
    before = counters(srv)
    gate = threading.Event()
    with opened(gate):
        subs = [Subscriber(srv, 64, kw, f"subscriber {i}", stop_at=2, gate=gate) for i in range(3)]
        for s in subs:
            s.wait_reached()
        assert {s.job_id for s in subs} == {subs[0].job_id}
        group = group_with(srv, str(subs[0].job_id), 3)
        assert group["detaches"] == 0, group
        page = httpx.get(f"{srv.http_url}/", headers=srv.headers, timeout=scaled(30)).text
        row = f"<tr><td class='l'>{kw['share']}</td><td>0</td><td>0</td><td>3</td>"
        assert row in page, "the status page shows no row for the group's 3 subscribers"
        gate.set()
        results = [s.result() for s in subs]
    after = counters(srv)
    for s, got in zip(subs, results, strict=True):
        assert_exact(s.name, got, want)
        assert s.stats is not None and s.stats.detached == 0, s.stats
        assert s.stats.transport == ("shm" if transport == "auto" else "tcp")
    assembled = (
        after["shardserve_batches_assembled_total"] - before["shardserve_batches_assembled_total"]
    )
    sent = after["shardserve_batches_sent_total"] - before["shardserve_batches_sent_total"]
    assert (assembled, sent) == (batches, 3 * batches), f"assembled {assembled}, sent {sent}"


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_paused_subscriber_is_detached_and_stalls_nobody(
    narrow: ServerProc, transport: str
) -> None:
    """With a window of 4 batches, a subscriber that stops after 2 batches of 60 does not hold
    the other two back: they finish their epoch while it waits; then it is told it was
    detached and gets the rest of its epoch, byte-exact."""
    kw = kwargs(
        200 + (transport == "tcp"), transport=transport, prefetch=4, share=f"pause-{transport}"
    )
    want = unshared_epoch(narrow, 32, kw)
    start, later = threading.Event(), threading.Event()
    with opened(start, later):
        paused = Subscriber(narrow, 32, kw, "paused subscriber", stop_at=2, gate=later)
        others = [
            Subscriber(narrow, 32, kw, f"subscriber {i}", stop_at=2, gate=start) for i in range(2)
        ]
        for s in (paused, *others):
            s.wait_reached()
        group_with(narrow, str(paused.job_id), 3)
        start.set()
        for s in others:  # while the paused one still waits at its batch 2
            assert_exact(s.name, s.result(), want)
        assert not paused.done.is_set() and len(paused.records) == 2
        # The metrics show it: the paused subscriber alone, far behind the group's front.
        series = f'{{job_id="{paused.job_id}",rank="0"}}'
        wait_until(
            lambda: (
                counter(narrow, "shardserve_job_share_lag_batches" + series) >= 40
                and counter(narrow, "shardserve_job_share_subscribers" + series) == 1
            ),
            "the share metrics to show one subscriber 40+ batches behind the front",
        )
        later.set()
        assert_exact(paused.name, paused.result(), want)
    # Told while it waited or when it went on (not when it joined: counted at its batch 2).
    assert paused.stats is not None and paused.stats_at_stop is not None
    assert paused.stats.detached > paused.stats_at_stop.detached, paused.stats


KILLED = """
import json, sys
from shardserve.client import Loader
with Loader(sys.argv[1], "cifar", 32, **json.loads(sys.argv[2])) as loader:
    loader.set_epoch(0)
    for i, _ in enumerate(loader):
        print(i, flush=True)
        if i == 20:
            sys.stdin.read()  # holds its stream open until the test kills this process
"""


def test_a_subscriber_killed_mid_epoch_stops_nobody(srv: ServerProc) -> None:
    """Two subscribers that stopped after 2 of 60 batches finish their epoch byte-exact after a
    third, reading ahead in another process, is killed with SIGKILL mid-epoch."""
    # The third is the group's front: batches are assembled for it. It claims a rank that a live
    # process holds: unshared, it would get RankInUse, see test_liveness.py.
    kw = kwargs(300, share="killed")
    want = unshared_epoch(srv, 32, kw)
    gate = threading.Event()
    with opened(gate):
        subs = [Subscriber(srv, 32, kw, f"subscriber {i}", stop_at=2, gate=gate) for i in range(2)]
        for s in subs:
            s.wait_reached()
        env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED, srv.http_url, json.dumps(kw)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
        reader.start()
        try:
            wait_until(
                lambda: proc.poll() is not None or (bool(lines) and int(lines[-1]) >= 10),
                "the subprocess subscriber's batch 10",
            )
            assert proc.poll() is None, f"the subscriber exited: {lines[-3:]} {proc.stderr.read()}"  # type: ignore[union-attr]
            group_with(srv, str(subs[0].job_id), 3)
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        finally:
            proc.kill()
            proc.wait(timeout=WAIT_S)
            reader.join(WAIT_S)
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    f.close()
        assert 10 <= int(lines[-1]) <= 20, lines[-3:]  # killed mid-epoch
        gate.set()
        for s in subs:
            assert_exact(s.name, s.result(), want)


def test_past_the_servers_share_budget_nothing_is_kept_and_nothing_is_wrong(
    store: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With ``--share-bytes 0`` no window is kept: a subscriber that waits while another
    reads the epoch assembles the epoch again, exact, and the kept-bytes gauge stays 0."""
    state = str(tmp_path_factory.mktemp("state"))
    with run_server(store, "--share-bytes", "0", "--state-dir", state) as none_kept:
        kw = kwargs(400, share="nothing-kept")
        want = unshared_epoch(none_kept, 64, kw)
        before = counters(none_kept)
        gate = threading.Event()
        with opened(gate):
            waiting = Subscriber(none_kept, 64, kw, "waiting subscriber", stop_at=1, gate=gate)
            waiting.wait_reached()
            reader = Subscriber(none_kept, 64, kw, "reading subscriber")
            assert_exact(reader.name, reader.result(), want)
            assert counter(none_kept, "shardserve_share_bytes") == 0
            gate.set()
            assert_exact(waiting.name, waiting.result(), want)
        after = counters(none_kept)
    assembled = (
        after["shardserve_batches_assembled_total"] - before["shardserve_batches_assembled_total"]
    )
    assert assembled == 2 * len(want), f"assembled {assembled} for two passes of {len(want)}"
