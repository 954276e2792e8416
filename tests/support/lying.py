"""A lying server: a real shardserve server behind a relay that rewrites what it says.

The relay is two real peers in front of the real server: an HTTP forwarder (every request
passed on with httpx; ``GET /v1/info`` names the relay's data endpoint, and a hook may rewrite
``GET .../plan`` bodies) and a ZeroMQ ROUTER that gives each client a DEALER of its own to
the server's tcp endpoint and passes every message back through a hook that may rewrite a
batch. A ``Loader`` pointed at :attr:`Relay.http_url` with ``transport="socket"`` then talks to
a server that lies exactly where the test says, and is correct everywhere else.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import zmq

from shardserve.proto.framing import decode_batch, encode_batch, peek_kind
from shardserve.proto.messages import BatchHeader, Kind
from tests.support.slowness import scaled

from .server import ServerProc

#: ``rewrite(header, payload) -> (header, payload)`` for each batch message server -> client.
BatchLie = Callable[[BatchHeader, list[bytes]], tuple[BatchHeader, list[bytes]]]
#: ``rewrite(plan body) -> plan body`` for ``GET /v1/jobs/{id}/plan``.
PlanLie = Callable[[bytes], bytes]


class Relay:
    """See the module docstring; the hooks may be set or swapped while it runs."""

    def __init__(self, srv: ServerProc) -> None:
        self.srv = srv
        self.batch_lie: BatchLie | None = None
        self.plan_lie: PlanLie | None = None
        #: Batch messages the hook rewrote.
        self.lies = 0
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self.data_endpoint = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._zmq = threading.Thread(target=self._relay, name="lying-zmq", daemon=True)
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.http_url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._web = threading.Thread(target=self._http.serve_forever, daemon=True)

    def start(self) -> None:
        self._zmq.start()
        self._web.start()

    def close(self) -> None:
        self._stop.set()
        self._zmq.join(timeout=scaled(10))
        self._http.shutdown()
        self._http.server_close()
        self._ctx.destroy(linger=0)

    # -- the data plane ----------------------------------------------------------------------

    def _relay(self) -> None:
        backs: dict[bytes, zmq.Socket] = {}
        owner: dict[zmq.Socket, bytes] = {}
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(50):
                    if sock is self._front:
                        ident, *frames = self._front.recv_multipart()
                        back = backs.get(ident)
                        if back is None:
                            back = backs[ident] = self._ctx.socket(zmq.DEALER)
                            back.setsockopt(zmq.LINGER, 0)
                            back.connect(self.srv.tcp_endpoint)
                            owner[back] = ident
                            poller.register(back, zmq.POLLIN)
                        back.send_multipart(frames)
                    else:
                        frames = sock.recv_multipart()
                        self._front.send_multipart([owner[sock], *self._rewrite(frames)])
        finally:
            for back in backs.values():
                back.close(linger=0)
            self._front.close(linger=0)

    def _rewrite(self, frames: list[bytes]) -> list[bytes]:
        lie = self.batch_lie
        if lie is None or peek_kind(frames[0]) is not Kind.BATCH:
            return frames
        header, payload = decode_batch(frames)
        new_header, new_payload = lie(header, [bytes(f) for f in payload])
        if new_header == header and new_payload == payload:
            return frames
        self.lies += 1
        return [bytes(f) for f in encode_batch(new_header, new_payload)]

    # -- the control plane -------------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        relay = self

        class Forward(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("host", "content-length", "connection")
                }
                r = httpx.request(
                    self.command,
                    relay.srv.http_url + self.path,
                    content=body,
                    headers=headers,
                    timeout=scaled(30),
                )
                content = r.content
                path = self.path.split("?", 1)[0]
                if path == "/v1/info" and r.status_code == 200:
                    info = json.loads(content)
                    info["data_endpoints"] = [relay.data_endpoint]
                    content = json.dumps(info).encode()
                elif path.endswith("/plan") and r.status_code == 200 and relay.plan_lie:
                    content = relay.plan_lie(content)
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PUT = do_DELETE = _forward

        return Forward


@contextmanager
def lying(srv: ServerProc) -> Iterator[Relay]:
    """A :class:`Relay` in front of ``srv`` for the block (no lies until a hook is set)."""
    relay = Relay(srv)
    relay.start()
    try:
        yield relay
    finally:
        relay.close()
