"""What the shared-pass tests (``test_share.py``, ``test_share_joins.py``) have in common: a
record of a batch's bytes, the unshared Loader's epoch to compare with, the server's counters and
share groups, and a ``Subscriber`` (one Loader of a share group in a thread that can stop at a
batch until a gate opens)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from shardserve.client import Loader, LoaderStats
from tests.support.data import make_cifar_like, sample_id_of
from tests.support.server import ServerProc, job_status
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


def write_store(root: Path) -> Path:
    """The tests' dataset: ``N`` cifar-like samples named ``cifar``."""
    make_cifar_like(root, "cifar", n=N)
    return root
