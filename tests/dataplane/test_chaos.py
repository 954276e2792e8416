"""Bounded chaos: while two jobs stream, peers are killed before and after their
Welcome, oversized specs are posted, Hellos flood in, and clients close under signals. The
two jobs still get every sample exactly once per epoch; the server stays ready and flat."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq

from shardserve.client.connection import read_boot_id
from shardserve.proto.framing import encode
from shardserve.proto.messages import Hello
from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, make_job, run_server
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]
N = 600
EPOCHS = 3

GOOD_RANK = """
import json, sys, time
from shardserve.client import Loader
from tests.support.data import sample_id_of
url, seed, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = []
with Loader(url, "cifar", batch_size=25, seed=seed, timeout=30, prefetch=2) as ld:
    for e in range(epochs):
        ld.set_epoch(e)
        ids = []
        for b in ld:
            ids += sample_id_of({"image": b["image"].numpy()}).tolist()
            time.sleep(0.01)  # a training step: keeps the stream open while chaos runs
        out.append(ids)
print(json.dumps(out))
"""

SLEEPER = """
import os, sys, time
import zmq
from shardserve.proto.framing import encode
from shardserve.proto.messages import Credit, Hello
boot_id = open("/proc/sys/kernel/random/boot_id").read().strip()  # same host: shm rings
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.connect(sys.argv[1])
s.send_multipart(encode(Hello(job=sys.argv[2], rank=0, epoch=int(sys.argv[3]), credit=4,
                              transport="auto", boot_id=boot_id, pid=os.getpid())))
s.send_multipart(encode(Credit(grant=4)))
print("sent", flush=True)
time.sleep(60)
"""

CLOSER = """
import signal, sys
from shardserve.client.connection import Connection
class Tick(Exception):
    pass
armed = False
def tick(sig, frame):
    # Disarms itself: one Tick per arming, so a second tick cannot land in the except clause
    # and escape the loop with the timer still running.
    global armed
    if armed:
        armed = False
        raise Tick()
signal.signal(signal.SIGALRM, tick)
signal.setitimer(signal.ITIMER_REAL, 0.0003, 0.0003)
for _ in range(100):
    c = Connection(sys.argv[1])
    while True:
        try:
            armed = True
            c.close()
            armed = False
            break
        except Tick:
            pass
signal.setitimer(signal.ITIMER_REAL, 0, 0)
"""


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _chaos_round(srv: ServerProc, ctx: zmq.Context, job: str, rng: random.Random) -> None:
    endpoint = srv.ipc_endpoint or srv.tcp_endpoint
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Peers SIGKILLed right after their Hello (before the Welcome) and a little later (after).
    sleepers = []
    for _ in range(2):
        p = subprocess.Popen(
            [sys.executable, "-c", SLEEPER, endpoint, job, str(rng.randrange(50))],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        sleepers.append(p)
    for p in sleepers:
        assert p.stdout is not None
        p.stdout.readline()
        time.sleep(rng.choice([0.0, 0.0, 0.05, 0.3]))  # before or after the Welcome
        p.send_signal(signal.SIGKILL)
    # Huge specs that leave no batch (drop_last): refused at creation, never reaching the data
    # plane. (Without drop_last a batch over the dataset is one short batch, sized by the data.)
    for bs in (2**20, 10**9):
        body = {"dataset": "cifar", "batch_size": bs, "drop_last": True}
        r = httpx.post(f"{srv.http_url}/v1/jobs", json=body, timeout=scaled(10))
        assert r.status_code == 422, r.text
    # A Hello flood from one peer, then it vanishes.
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(endpoint)
    for epoch in range(100):
        hello = Hello(
            job=job,
            rank=0,
            epoch=epoch,
            credit=8,
            transport="auto",
            boot_id=read_boot_id(),
            pid=os.getpid(),
        )
        flood.send_multipart(encode(hello))
    time.sleep(rng.random() * 0.1)
    flood.close(linger=0)
    for p in sleepers:
        p.wait(timeout=scaled(10))
        assert p.stdout is not None
        p.stdout.close()
    r = httpx.get(f"{srv.http_url}/readyz", timeout=scaled(5))
    assert r.status_code == 200, r.text


def _reap(p: subprocess.Popen[str]) -> None:
    """Kill a child still running (the test failed) and close its pipes: a Popen left to the
    garbage collector warns, and pytest pins that warning on whichever test runs then."""
    if p.poll() is None:
        p.kill()
    p.communicate(timeout=scaled(60))


def _good_rank(srv: ServerProc, seed: int, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", GOOD_RANK, srv.http_url, str(seed), str(EPOCHS)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_leaves_other_jobs_streaming_exactly_once(tmp_path: Path) -> None:
    """Under rounds of chaos two jobs (one of 2 ranks) read every epoch exactly once, /readyz stays 200 and the server's RSS stays flat."""
    store = tmp_path / "store"
    make_cifar_like(store, "cifar", n=N, shard_bytes=256 << 10)
    rng = random.Random(21)
    with run_server(store, "--heartbeat-s", "0.5") as srv:
        chaos_job = make_job(srv, batch_size=10, seed=1)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with zmq.Context() as ctx, contextlib.ExitStack() as children:
            _chaos_round(srv, ctx, chaos_job, rng)  # warm-up: first-use allocations
            rss0 = _rss(srv.proc.pid)
            good = [
                _good_rank(srv, seed, {**env, "RANK": str(rank), "WORLD_SIZE": str(world)})
                for seed, world in ((5, 2), (6, 1))
                for rank in range(world)
            ]
            for p in good:
                children.callback(_reap, p)
            # Clients closing under signals, all along.
            closer = subprocess.Popen(
                [sys.executable, "-c", CLOSER, srv.ipc_endpoint or srv.tcp_endpoint],
                cwd=ROOT,
                env=env,
                stderr=subprocess.PIPE,
                text=True,
            )
            children.callback(_reap, closer)
            rounds = 0
            while rounds < 3 or any(p.poll() is None for p in [*good, closer]):
                _chaos_round(srv, ctx, chaos_job, rng)
                rounds += 1
                assert rounds < 40, "the good jobs did not finish"
            _, err = closer.communicate(timeout=scaled(60))
            assert closer.returncode == 0, err[-2000:]
            results = []
            for p in good:
                out, err = p.communicate(timeout=scaled(60))
                assert p.returncode == 0, err[-3000:]
                results.append(json.loads(out))
            # The server has settled: every chaos stream was reclaimed.
            time.sleep(1.5)  # more than two heartbeats, so dead peers are noticed
            rss1 = _rss(srv.proc.pid)
        assert "streamer.crashed" not in srv.log_tail(1_000_000)
    two_ranks, one_rank = results[:2], results[2]
    for e in range(EPOCHS):
        assert sorted(two_ranks[0][e] + two_ranks[1][e]) == list(range(N)), f"epoch {e}"
        assert sorted(one_rank[e]) == list(range(N)), f"epoch {e}"
    assert rss1 - rss0 < 40 << 20, f"server RSS grew {(rss1 - rss0) >> 20} MiB over {rounds} rounds"
