"""A live trainer stays live while its loop computes: liveness comes from libzmq's ZMTP
heartbeats (answered by the client's I/O thread), not from the loop calling ``next()``, so
only a dead or frozen process loses its rank. Real server, real Loaders in real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardserve.client import Loader
from tests.support.data import make_cifar_like, sample_id_of
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_S = scaled(0.5)
N = 200
KW = {"seed": 21, "rank": 0, "world_size": 2, "timeout": 60.0, "transport": "socket"}

SECOND = """
import sys
from shardserve.client import Loader
from shardserve.proto.errors import RankInUse
with Loader(sys.argv[1], "cifar", 2, seed=21, rank=0, world_size=2, prefetch=2, timeout=60.0,
            transport="socket") as loader:
    loader.set_epoch(0)
    try:
        next(iter(loader))
    except RankInUse as e:
        print("RankInUse:", e)
        sys.exit(3)
print("got a batch")
"""

HOLDER = """
import sys, time
from shardserve.client import Loader
with Loader(sys.argv[1], "cifar", 2, seed=21, rank=0, world_size=2, prefetch=2, timeout=60.0,
            transport="socket") as loader:
    loader.set_epoch(0)
    next(iter(loader))
    print("holding", flush=True)
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("liveness")
    make_cifar_like(root, "cifar", n=N)
    with run_server(
        root, "--heartbeat-s", str(HEARTBEAT_S), "--stream-timeout-s", str(scaled(3.0))
    ) as s:
        yield s


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}


def _ids(batch: dict) -> list[int]:
    return sample_id_of({"image": batch["image"].numpy(), "label": batch["label"].numpy()}).tolist()


def test_a_trainer_computing_past_3_heartbeats_keeps_its_rank(srv: ServerProc) -> None:
    """The loop takes one batch, then computes (no next()) for far longer than 3 heartbeats
    while a second process claims its rank: the second gets RankInUse, and the first then
    reads the rest of its epoch, every sample once."""
    with Loader(srv.http_url, "cifar", 2, prefetch=2, **KW) as first:  # type: ignore[arg-type]
        first.set_epoch(0)
        it = iter(first)
        got = _ids(next(it))
        t0 = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-c", SECOND, srv.http_url],
            capture_output=True,
            text=True,
            timeout=scaled(120),
            env=_env(),
            cwd=ROOT,
        )
        busy = time.monotonic() - t0
        assert busy > 3 * HEARTBEAT_S
        assert second.returncode == 3, second.stdout + second.stderr
        assert "rank 0" in second.stdout and "world size 2" in second.stdout
        for batch in it:
            got += _ids(batch)
    assert len(got) == N // 2 and len(set(got)) == N // 2, f"computed {busy:.1f} s"


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_dead_or_frozen_trainer_loses_its_rank(srv: ServerProc, how: signal.Signals) -> None:
    """A holder killed (its connection closes) or frozen (SIGSTOP: its libzmq answers no
    PING) is reclaimed: a new Loader for its rank reads the whole epoch."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, srv.http_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()  # blocks until the holder has its first batch
        assert line.strip() == "holding", line + holder.stderr.read()  # type: ignore[union-attr]
        os.kill(holder.pid, how)
        with Loader(srv.http_url, "cifar", 2, prefetch=2, **KW) as new:  # type: ignore[arg-type]
            new.set_epoch(0)
            got = [i for b in new for i in _ids(b)]
        assert sorted(got) == sorted(set(got)) and len(got) == N // 2
    finally:
        holder.kill()
        holder.wait(timeout=scaled(30))
        for f in (holder.stdout, holder.stderr):
            if f is not None:
                f.close()


def test_two_loaders_of_the_process_for_a_rank_take_turns_and_say_so(
    srv: ServerProc, caplog: pytest.LogCaptureFixture
) -> None:
    """Two Loaders of one process for the same job and rank (a seed checked against itself):
    the newer takes the rank, the older is told, logs it, and takes the rank back when read
    again; each reads the whole epoch, every sample once."""
    kw = {**KW, "seed": 22}
    with Loader(srv.http_url, "cifar", 2, prefetch=2, **kw) as first:  # type: ignore[arg-type]
        first.set_epoch(0)
        old = iter(first)
        got_old = _ids(next(old))
        with Loader(srv.http_url, "cifar", 2, prefetch=2, **kw) as second:  # type: ignore[arg-type]
            second.set_epoch(0)
            got_new = [i for batch in second for i in _ids(batch)]
        with caplog.at_level("WARNING", logger="shardserve"):
            for batch in old:
                got_old += _ids(batch)
    assert sorted(got_old) == sorted(got_new) and len(set(got_new)) == N // 2
    assert "taken over by another Loader of this process" in caplog.text
