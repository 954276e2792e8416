"""Server process lifecycle: restart with its journal, SIGTERM, tokens, corrupt shards, unsafe binds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from shardserve.proto.errors import ErrorCode
from shardserve.proto.messages import Error, Reject, Welcome
from tests.server.rawclient import Batch, RawStream, zmq_context
from tests.support.data import make_cifar_like
from tests.support.server import free_port, run_server
from tests.support.slowness import scaled


def test_epoch_and_seed_survive_a_crash_and_restart(cifar_store: Path, tmp_path: Path) -> None:
    """Jobs and PUT epoch/seed are journaled: after kill -9 a server on the same ports reports and streams them."""
    http_port, data_port = free_port(), free_port()
    state = ["--state-dir", str(tmp_path / "state")]
    spec = {"dataset": "cifar", "batch_size": 100, "seed": 2, "world_size": 2}
    with run_server(cifar_store, *state, http_port=http_port, data_port=data_port) as srv:
        jid = httpx.post(f"{srv.http_url}/v1/jobs", json=spec, timeout=scaled(10)).json()["id"]
        r = httpx.put(
            f"{srv.http_url}/v1/jobs/{jid}/epoch", json={"epoch": 4, "seed": 17}, timeout=scaled(10)
        )
        assert r.status_code == 200
        srv.kill()
    with run_server(cifar_store, *state, http_port=http_port, data_port=data_port) as srv2:
        st = httpx.get(f"{srv2.http_url}/v1/jobs/{jid}", timeout=scaled(10)).json()
        assert (st["epoch"], st["seed"], st["spec"]["world_size"]) == (4, 17, 2)
        again = httpx.post(f"{srv2.http_url}/v1/jobs", json=spec, timeout=scaled(10))
        assert again.status_code == 200 and again.json()["id"] == jid
        assert srv2.tcp_endpoint == f"tcp://127.0.0.1:{data_port}"
        with zmq_context() as ctx:
            s = RawStream(ctx, srv2.tcp_endpoint)
            s.hello(jid, rank=1, epoch=4)
            assert s.recv_kind(Welcome).seed == 17
            s.close()


def test_sigterm_tells_streams_and_exits_zero(cifar_store: Path, tmp_path: Path) -> None:
    """SIGTERM: an open stream gets a non-fatal SERVER_SHUTDOWN error and the process exits 0 within a few seconds."""
    with run_server(cifar_store, "--state-dir", str(tmp_path)) as srv:
        jid = httpx.post(
            f"{srv.http_url}/v1/jobs",
            json={"dataset": "cifar", "batch_size": 10},
            timeout=scaled(10),
        ).json()["id"]
        with zmq_context() as ctx:
            s = RawStream(ctx, srv.tcp_endpoint)
            s.hello(jid, credit=1)
            s.recv_kind(Welcome)
            s.recv_kind(Batch)
            t0 = time.monotonic()
            code = srv.terminate(timeout=scaled(10.0))
            elapsed = time.monotonic() - t0
            err = s.recv_kind(Error, timeout=scaled(5))
            s.close()
        assert code == 0, srv.log_tail()
        assert err.code == ErrorCode.SERVER_SHUTDOWN and not err.fatal
        assert elapsed < scaled(10.0)
        assert "serve.exit" in srv.log_tail() and "signal=SIGTERM" in srv.log_tail()


def test_token_guards_http_and_data_plane(cifar_store: Path, tmp_path: Path) -> None:
    """With --token, HTTP needs the bearer token (except /healthz) and a Hello without it is Rejected."""
    with run_server(cifar_store, "--token", "s3cret", "--state-dir", str(tmp_path)) as srv:
        url = srv.http_url
        assert httpx.get(f"{url}/healthz", timeout=scaled(10)).status_code == 200
        for path in ("/readyz", "/v1/info", "/v1/datasets", "/metrics", "/"):
            assert httpx.get(f"{url}{path}", timeout=scaled(10)).status_code == 401, path
        assert (
            httpx.get(
                f"{url}/v1/info", headers={"Authorization": "Bearer nope"}, timeout=scaled(10)
            ).status_code
            == 401
        )
        # A browser gets a Basic challenge and may answer with the token as password.
        denied = httpx.get(f"{url}/", timeout=scaled(10))
        assert "Basic" in denied.headers["www-authenticate"]
        assert (
            httpx.get(f"{url}/", auth=("anyone", "s3cret"), timeout=scaled(10)).status_code == 200
        )
        assert httpx.get(f"{url}/", auth=("anyone", "wrong"), timeout=scaled(10)).status_code == 401
        info = httpx.get(f"{url}/v1/info", headers=srv.headers, timeout=scaled(10)).json()
        assert info["auth_required"] is True
        jid = httpx.post(
            f"{url}/v1/jobs",
            json={"dataset": "cifar", "batch_size": 10},
            headers=srv.headers,
            timeout=scaled(10),
        ).json()["id"]
        with zmq_context() as ctx:
            s = RawStream(ctx, srv.tcp_endpoint)
            s.hello(jid, token="wrong")
            assert s.recv_kind(Reject).code == ErrorCode.UNAUTHORIZED
            s.hello(jid, token="s3cret")
            s.recv_kind(Welcome)
            s.close()


def test_corrupt_shard_fails_the_job_not_the_server(cifar_store: Path, tmp_path: Path) -> None:
    """A flipped byte fails the job with the shard's name (fatal DATASET_CORRUPT on the stream); other datasets keep serving."""
    store = tmp_path / "store"
    shutil.copytree(cifar_store, store, ignore=shutil.ignore_patterns(".shardserve"))
    make_cifar_like(store, "good", n=100)
    shards = sorted((store / "cifar").rglob("*.arrow"))
    victim = shards[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with run_server(store, "--state-dir", str(tmp_path / "state")) as srv:
        bad = httpx.post(
            f"{srv.http_url}/v1/jobs",
            json={"dataset": "cifar", "batch_size": 1000, "shuffle": "none"},
            timeout=scaled(10),
        ).json()["id"]
        good = httpx.post(
            f"{srv.http_url}/v1/jobs",
            json={"dataset": "good", "batch_size": 50},
            timeout=scaled(10),
        ).json()["id"]
        with zmq_context() as ctx:
            s = RawStream(ctx, srv.tcp_endpoint)
            s.hello(bad, credit=2)
            s.recv_kind(Welcome)
            err = s.recv_kind(Error)
            assert (
                err.code == ErrorCode.DATASET_CORRUPT and err.fatal and victim.name in err.message
            )
            st = httpx.get(f"{srv.http_url}/v1/jobs/{bad}", timeout=scaled(10)).json()
            assert st["state"] == "failed" and victim.name in st["error"]
            s.hello(bad)
            assert s.recv_kind(Error).code == ErrorCode.DATASET_CORRUPT
            g = RawStream(ctx, srv.tcp_endpoint)
            g.hello(good, credit=2)
            g.recv_kind(Welcome)
            batches, _ = g.read_epoch()
            assert len(batches) == 2
            s.close()
            g.close()


def test_public_bind_without_token_is_refused(cifar_store: Path, tmp_path: Path) -> None:
    """serve on a non-loopback address without --token exits 2 and says to set a token or --insecure."""
    ready = tmp_path / "ready.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardserve.server",
            "serve",
            "--store",
            str(cifar_store),
            "--http",
            "0.0.0.0:0",
            "--ready-file",
            str(ready),
        ],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert out.returncode == 2 and "--insecure" in out.stderr and "token" in out.stderr
    assert not ready.exists()


@pytest.mark.parametrize("fmt", ["json"])
def test_json_logs_are_one_object_per_line(cifar_store: Path, tmp_path: Path, fmt: str) -> None:
    """With --log-format json every log line is a JSON object; stream events name job, rank and stream."""
    with run_server(cifar_store, "--log-format", fmt, "--state-dir", str(tmp_path)) as srv:
        jid = httpx.post(
            f"{srv.http_url}/v1/jobs",
            json={"dataset": "cifar", "batch_size": 500},
            timeout=scaled(10),
        ).json()["id"]
        with zmq_context() as ctx:
            s = RawStream(ctx, srv.tcp_endpoint)
            s.hello(jid, credit=2)
            s.recv_kind(Welcome)
            s.read_epoch()
            s.close()
        srv.terminate()
        lines = [json.loads(line) for line in srv.log_path.read_text().splitlines() if line.strip()]
    opened = [rec for rec in lines if rec["event"] == "stream.opened"]
    assert (
        opened and {"job", "rank", "stream", "epoch"} <= set(opened[0]) and opened[0]["job"] == jid
    )
    assert any(rec["event"] == "job.created" for rec in lines)
