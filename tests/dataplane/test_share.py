"""Shared passes (``Loader(share=...)``): subscribers of one rank's pass get exactly the bytes of
an unshared Loader of the same arguments, the server assembles each batch once for all of them,
a subscriber that falls behind the window is detached without stalling the others, one killed
with SIGKILL stops nobody, and late joiners and resumed subscribers are exact. Real server,
real Loaders (threads of this process, and one subprocess)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from shardserve.client import BadRequest, Loader, LoaderStats
from tests.support.data import make_cifar_like, sample_id_of
from tests.support.resume import assert_resumes_exactly
from tests.support.server import ServerProc, job_status, run_server
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]
N = 1920  # samples: 30 batches of 64, 60 batches of 32
#: How long a test waits for a condition before failing with what it waited for; generous, so
#: a busy machine only makes it slower. A healthy test waits well under a second.
WAIT_S = 90.0
#: The Loaders' own deadline for a batch: a stalled group fails with DataStallError.
BATCH_TIMEOUT_S = 45.0
#: Random crops and flips (seeded per job, epoch and sample), then float32: the bytes tell
#: whether the chain ran and with which randomness.
CROP_FLIP = [
    {"name": "random_crop", "params": {"size": 32, "padding": 4, "layout": "CHW"}},
    {"name": "hflip", "params": {"layout": "CHW"}},
    {"name": "normalize", "params": {"layout": "CHW", "scale": 1 / 255}},
]

#: One batch as compared: (field, dtype, shape, sha256 of the bytes) per field, and the labels.
Record = tuple[tuple[tuple[str, str, tuple[int, ...], str], ...], tuple[int, ...]]


def record(batch: dict[str, Any]) -> Record:
    parts = tuple(
        (
            k,
            str(t.dtype),
            tuple(t.shape),
            hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest(),
        )
        for k, t in sorted(batch.items())
    )
    return parts, tuple(batch["label"].tolist())


def wait_until(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)  # polling a condition with a deadline, not a fixed wait


def kwargs(seed: int, **kw: Any) -> dict[str, Any]:
    """Loader arguments of one test: rank 0 of 1, the given seed, an explicit prefetch (so
    every subscriber's stream sends the same batches per message)."""
    return {
        "seed": seed,
        "rank": 0,
        "world_size": 1,
        "prefetch": 8,
        "timeout": scaled(BATCH_TIMEOUT_S),
    } | kw


def unshared_epoch(srv: ServerProc, batch_size: int, kw: dict[str, Any]) -> list[Record]:
    """Epoch 0 of an unshared Loader of these arguments: what every subscriber must get."""
    records, ids = [], []
    with Loader(srv.http_url, "cifar", batch_size, **{**kw, "share": None}) as loader:
        loader.set_epoch(0)
        for b in loader:
            records.append(record(b))
            if kw.get("transforms") is None:
                ids.append(sample_id_of({"image": b["image"].numpy(), "label": b["label"].numpy()}))
        plan = _plan(srv, loader.job_id, batch_size)
    assert len(records) == N // batch_size
    labels = np.array([r[1] for r in records])
    assert np.array_equal(labels, plan % 10), "the unshared Loader's labels are not its plan's"
    if ids:
        assert np.array_equal(np.stack(ids), plan), "the unshared Loader's samples are not its plan"
    return records


def _plan(srv: ServerProc, job: str, batch_size: int) -> np.ndarray:
    r = httpx.get(
        f"{srv.http_url}/v1/jobs/{job}/plan",
        params={"epoch": 0, "rank": 0},
        headers=srv.headers,
        timeout=scaled(30),
    )
    assert r.status_code == 200, r.text
    return np.frombuffer(r.content, dtype="<i8").reshape(-1, batch_size)


def counter(srv: ServerProc, name: str) -> float:
    """A server-wide counter from ``GET /metrics``."""
    r = httpx.get(f"{srv.http_url}/metrics", headers=srv.headers, timeout=scaled(30))
    assert r.status_code == 200, r.text
    for line in r.text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def counters(srv: ServerProc) -> dict[str, float]:
    names = ("shardserve_batches_assembled_total", "shardserve_batches_sent_total")
    return {n: counter(srv, n) for n in names}


def share_groups(srv: ServerProc, job: str) -> list[dict[str, Any]]:
    """The job's share groups of rank 0, epoch 0 from ``GET /v1/jobs/{job}``."""
    return [g for g in job_status(srv, job).get("shares", []) if (g["rank"], g["epoch"]) == (0, 0)]


def group_with(srv: ServerProc, job: str, subscribers: int) -> dict[str, Any]:
    """Wait until the job's one group of rank 0, epoch 0 has ``subscribers``; that group."""
    seen: list[list[dict[str, Any]]] = []

    def ok() -> bool:
        seen.append(share_groups(srv, job))
        return len(seen[-1]) == 1 and seen[-1][0]["subscribers"] == subscribers

    wait_until(ok, f"one share group with {subscribers} subscribers")
    return seen[-1][0]


class Subscriber:
    """One Loader of a share group in a thread: records epoch 0's batches; with ``stop_at`` it
    stops after that many batches (``reached`` is set) until ``gate`` opens."""

    def __init__(
        self,
        srv: ServerProc,
        batch_size: int,
        kw: dict[str, Any],
        name: str,
        stop_at: int | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self.url, self.batch_size, self.kw, self.name = srv.http_url, batch_size, kw, name
        self.stop_at, self.gate = stop_at, gate
        self.records: list[Record] = []
        self.stats: LoaderStats | None = None
        self.stats_at_stop: LoaderStats | None = None
        self.job_id: str | None = None
        self.error: BaseException | None = None
        self.reached = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with Loader(self.url, "cifar", self.batch_size, **self.kw) as loader:
                self.job_id = loader.job_id
                loader.set_epoch(0)
                for b in loader:
                    self.records.append(record(b))
                    del b
                    if len(self.records) == self.stop_at:
                        self.stats_at_stop = loader.stats()
                        self.reached.set()
                        assert self.gate is not None
                        if not self.gate.wait(scaled(WAIT_S)):
                            raise AssertionError(f"{self.name}: its gate stayed shut {WAIT_S} s")
                self.stats = loader.stats()
        except BaseException as e:  # handed to the test's thread by result()
            self.error = e
        finally:
            self.reached.set()
            self.done.set()

    def wait_reached(self) -> None:
        """Wait until it stopped at ``stop_at`` (it holds its stream open there)."""
        if not self.reached.wait(scaled(WAIT_S)):
            raise AssertionError(
                f"{self.name} did not reach batch {self.stop_at} within {WAIT_S} s"
            )
        self._raise()
        assert not self.done.is_set(), f"{self.name} ended before batch {self.stop_at}"

    def result(self) -> list[Record]:
        """Wait for the end of its epoch; its batches (its error, if it failed)."""
        self._thread.join(WAIT_S)
        if self._thread.is_alive():
            raise AssertionError(
                f"{self.name} did not finish its epoch within {WAIT_S} s ({len(self.records)} batches)"
            )
        self._raise()
        return self.records

    def _raise(self) -> None:
        if self.error is not None:
            raise AssertionError(f"{self.name} failed: {self.error!r}") from self.error


@contextmanager
def opened(*gates: threading.Event) -> Iterator[None]:
    """Open every gate on the way out, so no thread is left waiting on a failed test."""
    try:
        yield
    finally:
        for g in gates:
            g.set()


def assert_exact(name: str, got: list[Record], want: list[Record]) -> None:
    assert len(got) == len(want), f"{name}: {len(got)} batches, the unshared Loader {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a == b, f"{name}: batch {i} differs from the unshared Loader's"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("share")
    make_cifar_like(root, "cifar", n=N)
    return root


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
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env, cwd=ROOT,
        )  # fmt: skip
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


def test_a_shared_mixture_is_refused_at_creation(srv: ServerProc) -> None:
    """A mixture job with a share name is refused when it is created, over HTTP and by the
    Loader; the same mixture without one is created."""
    body = {"mixture": [{"name": "cifar", "weight": 1.0}], "batch_size": 64}
    url = f"{srv.http_url}/v1/jobs"
    r = httpx.post(url, json=body, headers=srv.headers, timeout=scaled(30))
    assert r.status_code == 201, r.text
    r = httpx.post(url, json=body | {"share": "mix"}, headers=srv.headers, timeout=scaled(30))
    assert r.status_code == 422 and "share" in r.text, r.text
    with pytest.raises(BadRequest, match="share"):
        Loader(srv.http_url, {"cifar": 1.0}, 64, share="mix", timeout=scaled(BATCH_TIMEOUT_S))


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
