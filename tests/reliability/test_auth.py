"""Authentication, extending tests/server/test_lifecycle.py's token test.

Here: every OpenAPI operation (plus the docs routes) needs the token, the token from the
environment, a Hello with no token on both transports, the Loader with ``token=`` and with
``SHARDSERVE_TOKEN``, a non-loopback *data* bind without a token, and ``--insecure``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from shardserve.client import AuthError, Loader
from shardserve.proto.errors import ErrorCode
from shardserve.proto.messages import Reject, Welcome
from tests.server.rawclient import RawStream, zmq_context
from tests.support.data import sample_id_of
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

TOKEN = "t0ken-for-tests"


@pytest.fixture(scope="module")
def auth_server(rel_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """A server whose token comes from the environment (SHARDSERVE_TOKEN), not a flag."""
    state = tmp_path_factory.mktemp("authstate")
    with run_server(rel_store, "--state-dir", str(state), env={"SHARDSERVE_TOKEN": TOKEN}) as srv:
        assert srv.token == TOKEN
        yield srv


def _operations(srv: ServerProc) -> list[tuple[str, str]]:
    schema = httpx.get(
        f"{srv.http_url}/openapi.json", headers=srv.headers, timeout=scaled(10)
    ).json()
    ops = []
    for path, item in schema["paths"].items():
        concrete = re.sub(r"\{[^}]+\}", "0123456789abcdef", path)
        for method in item:
            if method in ("get", "post", "put", "delete", "patch"):
                ops.append((method.upper(), concrete))
    return ops


def test_every_operation_but_healthz_needs_the_token(auth_server: ServerProc) -> None:
    """Every operation in /openapi.json answers 401 without, with a wrong, or with a non-Basic-encoded token, and not 401 with it; /healthz is open."""
    ops = _operations(auth_server)
    assert len(ops) >= 10
    _check_guarded(auth_server, ops)


def test_schema_and_docs_routes_need_the_token(auth_server: ServerProc) -> None:
    """/openapi.json needs the token too, and no unguarded docs pages (/docs, /redoc) exist."""
    _check_guarded(auth_server, [("GET", "/openapi.json")])
    url = auth_server.http_url
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert (
            httpx.get(f"{url}{path}", headers=auth_server.headers, timeout=scaled(10)).status_code
            == 404
        )
    schema = httpx.get(f"{url}/openapi.json", headers=auth_server.headers, timeout=scaled(10))
    assert schema.status_code == 200 and "/v1/jobs" in schema.json()["paths"]


def _check_guarded(auth_server: ServerProc, ops: list[tuple[str, str]]) -> None:
    url = auth_server.http_url
    body = {"dataset": "cifar", "batch_size": 10}
    unguarded = []
    for method, path in ops:
        kw = (
            {"json": body if method == "POST" else {"epoch": 1}}
            if method in ("POST", "PUT")
            else {}
        )
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
            r = httpx.request(method, f"{url}{path}", headers=headers, timeout=scaled(10), **kw)
            if path == "/healthz":
                assert r.status_code == 200
            elif r.status_code != 401:
                unguarded.append((method, path, headers, r.status_code))
        r = httpx.request(
            method, f"{url}{path}", headers=auth_server.headers, timeout=scaled(10), **kw
        )
        assert r.status_code != 401 and r.status_code < 500, (method, path, r.status_code)
    assert not unguarded, f"answered without the token: {unguarded}"


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_hello_without_token_is_rejected(auth_server: ServerProc, transport: str) -> None:
    """A Hello with no token is Rejected UNAUTHORIZED on tcp and ipc; the same socket then streams with the token."""
    jid = httpx.post(
        f"{auth_server.http_url}/v1/jobs",
        json={"dataset": "other", "batch_size": 100},
        headers=auth_server.headers,
        timeout=scaled(10),
    ).json()["id"]
    endpoint = auth_server.tcp_endpoint if transport == "tcp" else auth_server.ipc_endpoint
    assert endpoint
    with zmq_context() as ctx:
        s = RawStream(ctx, endpoint)
        s.hello(jid, nonce=3)
        r = s.recv_kind(Reject)
        assert r.code == ErrorCode.UNAUTHORIZED and r.nonce == 3 and "token" in r.message
        s.hello(jid, token=TOKEN[:-1])
        assert s.recv_kind(Reject).code == ErrorCode.UNAUTHORIZED
        s.hello(jid, token=TOKEN, credit=2)
        s.recv_kind(Welcome)
        batches, _ = s.read_epoch()
        assert len(batches) == 2
        s.close()


def test_loader_token_argument_and_environment(
    auth_server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Loader without the token raises AuthError; with token= or SHARDSERVE_TOKEN it reads a whole epoch."""
    monkeypatch.delenv("SHARDSERVE_TOKEN", raising=False)
    with pytest.raises(AuthError):
        Loader(auth_server.http_url, "other", batch_size=50, timeout=scaled(10))
    with pytest.raises(AuthError):
        Loader(auth_server.http_url, "other", batch_size=50, timeout=scaled(10), token="wrong")
    with Loader(
        auth_server.http_url, "other", batch_size=50, timeout=scaled(10), token=TOKEN
    ) as ld:
        ids = np.concatenate([sample_id_of({"image": b["image"].numpy()}) for b in ld])
    assert np.array_equal(np.sort(ids), np.arange(200))
    monkeypatch.setenv("SHARDSERVE_TOKEN", TOKEN)
    with Loader(
        auth_server.http_url, "other", batch_size=40, timeout=scaled(10), transport="tcp"
    ) as ld:
        ids = np.concatenate([sample_id_of({"image": b["image"].numpy()}) for b in ld])
    assert np.array_equal(np.sort(ids), np.arange(200))


def _serve(store: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "shardserve.server",
            "serve",
            "--store",
            str(store),
            "--ready-file",
            str(tmp / "ready.json"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )


@pytest.mark.parametrize(
    "args",
    [
        ("--http", "0.0.0.0:0"),
        ("--http", "127.0.0.1:0", "--data", "tcp://0.0.0.0:0"),
        ("--http", "127.0.0.1:0", "--data", "tcp://*:0"),
        ("--http", "[::]:0"),
    ],
    ids=["http-any", "data-any", "data-star", "http-v6-any"],
)
def test_public_bind_without_token_exits_naming_the_fix(
    rel_store: Path, tmp_path: Path, args: tuple[str, ...]
) -> None:
    """Binding HTTP or data to a non-loopback address without a token exits non-zero, names --token and --insecure, and never becomes ready."""
    out = _serve(rel_store, tmp_path, "--state-dir", str(tmp_path / "st"), *args)
    assert out.returncode != 0
    assert "--token" in out.stderr and "--insecure" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "ready.json").exists()


def test_insecure_allows_a_public_bind(rel_store: Path, tmp_path: Path) -> None:
    """With --insecure the same non-loopback binds start and serve without a token."""
    with run_server(
        rel_store,
        "--state-dir",
        str(tmp_path / "st"),
        "--http",
        "0.0.0.0:0",
        "--data",
        "tcp://0.0.0.0:0",
        "--insecure",
    ) as srv:
        port = srv.http_url.rsplit(":", 1)[1]
        assert httpx.get(f"http://127.0.0.1:{port}/v1/info", timeout=scaled(10)).status_code == 200
    with run_server(
        rel_store,
        "--state-dir",
        str(tmp_path / "st2"),
        "--http",
        "0.0.0.0:0",
        env={"SHARDSERVE_TOKEN": TOKEN},
    ) as srv:  # a token also makes a public bind acceptable
        port = srv.http_url.rsplit(":", 1)[1]
        assert httpx.get(f"http://127.0.0.1:{port}/v1/info", timeout=scaled(10)).status_code == 401
