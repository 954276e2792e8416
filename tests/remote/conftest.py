"""A real S3 wire protocol on loopback: moto's server, talked to by pyarrow's own S3 client.

``s3`` starts moto's S3 app on a werkzeug server on 127.0.0.1 (a fixed free port, so a test
can stop it and start it again on the same address), creates a bucket, and sets the
environment a user would: endpoint, region and (fake) credentials whose values the tests then
look for in every log, error and page.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.support.server import free_port
from tests.support.slowness import scaled

#: Fake credentials: any appearance of these in output is a leak.
ACCESS_KEY = "AKIASHARDSERVELEAK01"
SECRET_KEY = "s3cr3t-shardserve-never-shown-0123456789"
BUCKET = "shards"


class MotoServer:
    """moto's S3 app served on ``host:port`` until :meth:`stop`.

    Not moto's ``ThreadedMotoServer``: its ``stop`` leaves the listening socket open for as
    long as a request thread still holds the server (seen on a loaded machine), so starting
    again on the same port failed to bind, and its ``start`` then waited forever for a thread
    that had died. Here the bind happens in the caller and raises, and ``stop`` closes it.
    """

    def __init__(self, host: str, port: int) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server(
            host, port, app, threaded=True, request_handler=MotoRequestHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"moto-s3-{port}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=scaled(30))  # serve_forever returned in shutdown: a formality


@dataclass
class S3:
    """A running moto S3 server and what a client needs to reach it."""

    server: MotoServer
    host: str
    port: int

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a server or CLI subprocess needs in its environment."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def uri(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        """Start again on the same port; moto keeps its buckets in this process meanwhile."""
        self.server = MotoServer(self.host, self.port)

    def filesystem(self) -> object:
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(
            endpoint_override=f"{self.host}:{self.port}",
            scheme="http",
            region="us-east-1",
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY,
            allow_bucket_creation=True,
            allow_bucket_deletion=True,
        )


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    """A fresh moto S3 server with one empty bucket; the environment points at it."""
    pytest.importorskip(
        "moto.server", reason="moto[server] is not installed (pip install -e '.[dev]')"
    )
    port = free_port()
    s = S3(MotoServer("127.0.0.1", port), "127.0.0.1", port)
    for k, v in s.env.items():
        monkeypatch.setenv(k, v)
    # moto keeps buckets in process-global state, and a test that failed with the endpoint
    # stopped could not empty them: start from nothing. moto builds its S3 backend on the first
    # request, which on a loaded machine takes longer than pyarrow's 3 s low-speed limit, so
    # both go over plain HTTP with a deadline.
    httpx.post(f"{s.endpoint}/moto-api/reset", timeout=scaled(60))
    r = httpx.put(f"{s.endpoint}/{BUCKET}", timeout=scaled(60))
    assert r.status_code == 200, f"moto did not create bucket {BUCKET!r}: {r.status_code} {r.text}"
    try:
        yield s
    finally:
        # moto keeps buckets in process-global state: empty it for the next test.
        with contextlib.suppress(httpx.TransportError):
            httpx.post(f"{s.endpoint}/moto-api/reset", timeout=scaled(5))
        with contextlib.suppress(Exception):
            s.stop()
