"""A real S3 wire protocol on loopback: moto's server, talked to by pyarrow's own S3 client.

``s3`` starts ``ThreadedMotoServer`` on 127.0.0.1 (a fixed free port, so a test can stop it
and start it again on the same address), creates a bucket, and sets the environment a user
would: endpoint, region and (fake) credentials whose values the tests then look for in every
log, error and page.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.support.server import free_port

#: Fake credentials: any appearance of these in output is a leak.
ACCESS_KEY = "AKIASHARDSERVELEAK01"
SECRET_KEY = "s3cr3t-shardserve-never-shown-0123456789"
BUCKET = "shards"


@dataclass
class S3:
    """A running moto S3 server and what a client needs to reach it."""

    server: object
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
        self.server.stop()  # type: ignore[attr-defined]

    def start(self) -> None:
        """Start again on the same port; moto keeps its buckets in this process meanwhile."""
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
        self.server.start()  # type: ignore[attr-defined]

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
    moto_server = pytest.importorskip(
        "moto.server", reason="moto[server] is not installed (pip install -e '.[dev]')"
    )
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    s = S3(server, "127.0.0.1", port)
    for k, v in s.env.items():
        monkeypatch.setenv(k, v)
    # moto keeps buckets in process-global state, and a test that failed with the endpoint
    # stopped could not empty them: start from nothing. moto builds its S3 backend on the first
    # request, which on a loaded machine takes longer than pyarrow's 3 s low-speed limit, so
    # both go over plain HTTP with a deadline.
    httpx.post(f"{s.endpoint}/moto-api/reset", timeout=60)
    r = httpx.put(f"{s.endpoint}/{BUCKET}", timeout=60)
    assert r.status_code == 200, f"moto did not create bucket {BUCKET!r}: {r.status_code} {r.text}"
    try:
        yield s
    finally:
        # moto keeps buckets in process-global state: empty it for the next test.
        with contextlib.suppress(httpx.TransportError):
            httpx.post(f"{s.endpoint}/moto-api/reset", timeout=5)
        with contextlib.suppress(Exception):
            s.stop()
