"""Client death: a SIGKILLed client's stream is reclaimed; others keep streaming."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shardserve.proto.messages import Welcome
from tests.reliability.conftest import make_job, wait_until
from tests.server.rawclient import Batch, RawStream, zmq_context
from tests.support.data import sample_id_of
from tests.support.server import ServerProc, job_status, run_server
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]
RECLAIM_DEADLINE_S = 20.0


def _start_client(*args: str) -> tuple[subprocess.Popen[str], dict]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability._dying_client", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    # The client prints one line once it holds a stream; it gives up by itself after 20 s.
    line = proc.stdout.readline()
    try:
        return proc, json.loads(line)
    except ValueError:
        proc.kill()
        rest = proc.stdout.read()
        proc.wait(timeout=scaled(10))
        proc.stdout.close()
        raise AssertionError(f"client not ready (exit {proc.returncode}): {line}{rest}") from None


@pytest.fixture(scope="module")
def death_server(rel_store: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server with short heartbeats so that reclaiming is quick."""
    state = tmp_path_factory.mktemp("deathstate")
    with run_server(rel_store, "--state-dir", str(state), "--heartbeat-s", "0.5") as srv:
        yield srv


@pytest.mark.parametrize("mode", ["raw-shm", "loader"])
def test_sigkilled_client_is_reclaimed_and_others_keep_streaming(
    death_server: ServerProc, mode: str
) -> None:
    """After SIGKILL of a client mid-stream its rank shows disconnected within a bounded time, its shm ring is gone, and another stream completes its epoch."""
    srv = death_server
    if mode == "raw-shm":
        job = make_job(srv, batch_size=10, seed=11)
        proc, info = _start_client("raw", srv.ipc_endpoint or srv.tcp_endpoint, job)
        assert info["transport"] == "shm" and info["shm"], info  # same host: shared memory
        ring = Path("/dev/shm") / info["shm"]
        assert ring.exists()
    else:
        job = make_job(srv, batch_size=10, seed=5)
        proc, info = _start_client("loader", srv.http_url, "cifar")
        ring = None
    try:
        assert job_status(srv, job)["ranks"][0]["connected"]
        # A healthy peer streaming while the other dies.
        with zmq_context() as ctx:
            other_job = make_job(srv, dataset="other", batch_size=20, seed=1)
            g = RawStream(ctx, srv.tcp_endpoint)
            g.hello(other_job, credit=2)
            g.recv_kind(Welcome)
            first = g.recv_kind(Batch)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=scaled(10))
            t0 = time.monotonic()
            wait_until(
                lambda: not job_status(srv, job)["ranks"][0]["connected"],
                scaled(RECLAIM_DEADLINE_S),
                f"rank 0 of job {job} shown disconnected after its client was SIGKILLed",
            )
            reclaim_s = time.monotonic() - t0
            if ring is not None:
                wait_until(
                    lambda: not ring.exists(), 5.0, f"shm ring {ring} unlinked after reclaim"
                )
            g.grant(1)
            batches, eoe = g.read_epoch()
            got = [first, *batches]
            ids = np.concatenate([sample_id_of(b.parts) for b in got])
            assert eoe.num_batches == len(got) and np.array_equal(np.sort(ids), np.arange(200))
            g.close()
        leftovers = (
            [p.name for p in Path("/dev/shm").glob(f"shardserve-{srv.proc.pid}-*")]
            if mode == "raw-shm"
            else []
        )
        assert leftovers == [], f"rings of the server still present: {leftovers}"
        assert reclaim_s < scaled(RECLAIM_DEADLINE_S)
        assert srv.proc.poll() is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=scaled(10))
        assert proc.stdout is not None
        proc.stdout.close()
