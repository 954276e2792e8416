"""The edges: Host allow-list, idle HTTP connections, client close under signals,
damaged state dicts, a server that is restarting."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from shardserve.client import BadRequest, Loader, ServerUnavailable
from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, free_port, make_job, run_server
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("edgestore")
    make_cifar_like(root, "cifar", n=200)
    return root


@pytest.fixture(scope="module")
def srv(store: Path):
    with run_server(store, "--http-idle-timeout-s", "1") as s:
        yield s


def _port(srv: ServerProc) -> int:
    return int(srv.http_url.rsplit(":", 1)[1])


def test_foreign_host_header_is_refused(srv: ServerProc) -> None:
    """A request naming another host (DNS rebinding from a web page) gets 403 for GET, POST and DELETE; loopback names get through."""
    evil = {"Host": "attacker.example"}
    url = srv.http_url
    job = make_job(srv, batch_size=10)
    assert httpx.get(f"{url}/v1/jobs", headers=evil, timeout=scaled(10)).status_code == 403
    r = httpx.post(
        f"{url}/v1/jobs",
        json={"dataset": "cifar", "batch_size": 5},
        headers=evil,
        timeout=scaled(10),
    )
    assert r.status_code == 403 and "--allowed-host" in r.json()["detail"]
    assert httpx.delete(f"{url}/v1/jobs/{job}", headers=evil, timeout=scaled(10)).status_code == 403
    assert httpx.get(f"{url}/v1/jobs/{job}", timeout=scaled(10)).status_code == 200  # not deleted
    port = _port(srv)
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert (
            httpx.get(f"{url}/v1/info", headers={"Host": host}, timeout=scaled(10)).status_code
            == 200
        ), host


def test_allowed_hosts_are_configurable(store: Path) -> None:
    """``--allowed-host`` adds a name: it is answered, as are loopback names; others are not."""
    with run_server(store, "--allowed-host", "trainer.internal") as s:
        ok = httpx.get(
            f"{s.http_url}/v1/info", headers={"Host": "trainer.internal:1"}, timeout=scaled(10)
        )
        assert ok.status_code == 200
        assert (
            httpx.get(
                f"{s.http_url}/v1/info", headers={"Host": "evil.example"}, timeout=scaled(10)
            ).status_code
            == 403
        )


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_and_slow_http_connections_are_closed(srv: ServerProc) -> None:
    """Connections that never finish a request (idle, or trickling a header) are closed by the server after the idle timeout, so its fds come back."""
    before = _fds(srv.proc.pid)
    socks = []
    for i in range(30):
        s = socket.create_connection(("127.0.0.1", _port(srv)), timeout=scaled(10))
        if i % 2:
            s.sendall(b"GET /v1/info HTTP/1.1\r\nHo")  # a header that never ends
        socks.append(s)
    deadline = time.monotonic() + scaled(10)
    while _fds(srv.proc.pid) < before + 20 and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for the server to accept them, with a deadline
    assert _fds(srv.proc.pid) >= before + 20
    for s in socks:
        assert s.recv(1) == b"", "the server kept an idle connection open"
        s.close()
    deadline = time.monotonic() + scaled(10)
    while _fds(srv.proc.pid) > before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the fd count with a deadline
    assert _fds(srv.proc.pid) <= before + 2
    # A connection in use is not cut: a keep-alive client makes requests across the timeout.
    with httpx.Client() as c:
        for _ in range(3):
            assert c.get(f"{srv.http_url}/v1/info").status_code == 200
            time.sleep(0.4)


CLOSER = """
import os, signal, sys, threading
from shardserve.client.connection import Connection

class Tick(Exception):
    pass

armed = False

def raise_tick(sig, frame):
    if armed:  # only inside the calls under test, so the loop itself is never hit
        raise Tick()

def counts():
    return len(os.listdir("/proc/self/fd")), threading.active_count()

endpoint = sys.argv[1]
Connection(endpoint).close()  # warm imports and libzmq
base = counts()
signal.signal(signal.SIGALRM, raise_tick)
signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
interrupted = 0
for _ in range(300):
    conn = Connection(endpoint)
    while True:
        try:
            armed = True
            conn.close()
            armed = False
            break
        except Tick:
            armed = False
            interrupted += 1
signal.setitimer(signal.ITIMER_REAL, 0, 0)
print(base[0], base[1], *counts(), interrupted)
"""


def test_connection_close_interrupted_by_signals_leaks_nothing(srv: ServerProc) -> None:
    """300 Connection.close() calls under a 0.2 ms timer whose handler raises leave no ZeroMQ I/O thread and no fd behind."""
    out = subprocess.run(
        [sys.executable, "-c", CLOSER, srv.tcp_endpoint],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    fd0, th0, fd1, th1, interrupted = map(int, out.stdout.split())
    assert interrupted > 0, "the timer never fired: the test did not test anything"
    assert fd1 <= fd0 + 1, (fd0, fd1)
    assert th1 <= th0 + 1, (th0, th1)


def test_damaged_state_dicts_get_clear_errors(srv: ServerProc) -> None:
    """Each kind of damage to a state dict is a BadRequest naming the key and what to change, never a KeyError or a raw pydantic dump."""
    with Loader(srv.http_url, "cifar", batch_size=10, seed=1, timeout=scaled(20)) as ld:
        good = ld.state_dict()
        cases = [
            ("not a dict", "must be the dict"),
            ({k: v for k, v in good.items() if k != "epoch"}, "lacks key(s) ['epoch']"),
            ({**good, "epoch": "3"}, "'epoch' is '3'"),
            ({**good, "next_batch": -1}, "'next_batch' is -1"),
            (
                {**good, "next_batch": 10_000, "position": 100_000},
                "out of range 0 <= next_batch <= 20",
            ),
            ({**good, "epoch": 2**31}, "'epoch' is 2147483648; expected an integer 0 <= epoch"),
            ({**good, "next_batch": 2**60}, "'next_batch' is 1152921504606846976; expected"),
            ({**good, "position": -1}, "'position' is -1"),
            ({**good, "next_batch": 3}, "'position' (0) and 'next_batch' (3) disagree"),
            ({**good, "job": 7}, "'job' is 7"),
            ([good, {**good, "rank": 0}], "one state of each rank 0..0"),
            ([], "non-empty list"),
            ({**good, "spec": {**good["spec"], "batch_size": "big"}}, "not a valid job spec"),
            ({**good, "spec": None}, "expected the job spec dict"),
            ({**good, "rank": 3}, "rank 3 out of range"),
            ({**good, "version": 99}, "state version 99"),
        ]
        for state, says in cases:
            with pytest.raises(BadRequest) as e:
                ld.load_state_dict(state)  # type: ignore[arg-type]
            assert says in str(e.value), (state, str(e.value))
        ld.load_state_dict(good)  # the undamaged one still loads


def test_loader_waits_for_a_restarting_server_within_timeout(store: Path) -> None:
    """A Loader made while its server is down (restarting) connects once it is back, within ``timeout``; with nobody ever coming it raises ServerUnavailable after ``timeout``, not at once."""
    http, data = free_port(), free_port()
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match=r"for 1\.0 s"):
        Loader(f"http://127.0.0.1:{http}", "cifar", batch_size=10, timeout=1.0)
    assert time.monotonic() - t0 >= 0.9

    holder: dict[str, object] = {}
    started = threading.Event()
    stop = threading.Event()

    def late_server() -> None:
        time.sleep(1.0)  # the server is "restarting" for a while
        with run_server(store, http_port=http, data_port=data) as s:
            holder["srv"] = s
            started.set()
            stop.wait(scaled(60))

    t = threading.Thread(target=late_server, daemon=True)
    t.start()
    try:
        with Loader(f"http://127.0.0.1:{http}", "cifar", batch_size=10, timeout=scaled(30)) as ld:
            n = sum(b["image"].shape[0] for b in ld)
        assert n == 200
        # The Loader can finish before run_server's own readiness poll returns.
        assert started.wait(scaled(30))
    finally:
        stop.set()
        t.join(scaled(30))
