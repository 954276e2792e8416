"""What a peer reports is checked and what a peer names is escaped.

Client telemetry (``Credit``/``Heartbeat`` stats) with ``Infinity``, ``NaN``, absurd seconds or
counts is refused with a typed error and never reaches the status page or metrics; a job id
with a newline reaches the text log as one escaped value, not as a forged log line.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest

from shardserve.proto.errors import ErrorCode
from shardserve.proto.messages import PROTOCOL_VERSION, ClientStats, Error, Welcome
from tests.reliability.conftest import make_job, wait_until
from tests.reliability.test_wire_hostile import replies_until_barrier
from tests.server.rawclient import RawStream, zmq_context
from tests.support.server import ServerProc
from tests.support.slowness import scaled

#: What every message's header frame starts with: the magic and this protocol's version.
HEAD = b"SS" + bytes([PROTOCOL_VERSION])

BAD_STATS = [
    b'{"batches": 1, "wait_s": Infinity, "compute_s": 1.0}',
    b'{"batches": 1, "wait_s": 1.0, "compute_s": -Infinity}',
    b'{"batches": 1, "wait_s": NaN, "compute_s": 1.0}',
    b'{"batches": 1, "wait_s": 1e300, "compute_s": 1.0}',
    b'{"batches": 100000000000000000000000, "wait_s": 1.0, "compute_s": 1.0}',
]


@pytest.mark.parametrize("kind", [b"\x04", b"\x07"], ids=["credit", "heartbeat"])
def test_non_finite_or_absurd_stats_are_refused(rel_server: ServerProc, kind: bytes) -> None:
    """Each bad stats report gets a typed MALFORMED error naming the field; the status page and
    /metrics show only finite numbers afterwards and the stream still serves."""
    job = make_job(rel_server, dataset="other", seed=11)
    with zmq_context() as ctx:
        s = RawStream(ctx, rel_server.tcp_endpoint)
        s.hello(job, credit=1)
        s.recv_kind(Welcome)
        for stats in BAD_STATS:
            body = (
                b'{"grant": 0, "stats": ' + stats + b"}"
                if kind == b"\x04"
                else b'{"stats": ' + stats + b"}"
            )
            s.send_raw([HEAD + kind + body])
            replies = [r for r in replies_until_barrier(s) if isinstance(r, Error)]
            assert len(replies) == 1 and replies[0].code == ErrorCode.MALFORMED, (stats, replies)
            assert (
                "wait_s" in replies[0].message
                or "compute_s" in replies[0].message
                or ("batches" in replies[0].message)
            ), replies[0].message
        s.close()
    r = httpx.get(f"{rel_server.http_url}/v1/jobs/{job}", timeout=scaled(10))
    for rank in r.json()["ranks"]:
        for k in ("wait_s", "compute_s", "batches_per_s"):
            assert math.isfinite(rank[k]), (k, rank)
    metrics = httpx.get(f"{rel_server.http_url}/metrics", timeout=scaled(10)).text
    assert not [ln for ln in metrics.splitlines() if job in ln and ("Inf" in ln or "NaN" in ln)]


def test_stats_bounds_in_the_contract() -> None:
    """The contract itself: finite, non-negative, bounded; good values still pass."""
    assert ClientStats.model_validate_json(b'{"batches": 3, "wait_s": 0.5, "compute_s": 2}')
    for raw in BAD_STATS:
        with pytest.raises(ValueError):
            ClientStats.model_validate_json(raw)


def test_job_id_with_newline_is_escaped_in_the_text_log(rel_server: ServerProc) -> None:
    """A Hello whose job id carries a newline and a fake record is logged as one quoted value."""
    evil = "x\n2099-01-01T00:00:00.000Z\tERROR\tshardserve.fake\tforged"
    with zmq_context() as ctx:
        s = RawStream(ctx, rel_server.tcp_endpoint)
        s.send_raw(
            [
                HEAD
                + b"\x01"
                + json.dumps(
                    {"job": evil, "rank": 0, "epoch": 0, "credit": 1, "transport": "socket"}
                ).encode()
            ]
        )
        reply = s.recv(what="the refusal of the evil Hello")
        assert isinstance(reply, Error) and reply.code == ErrorCode.JOB_NOT_FOUND
        s.close()
    escaped = json.dumps(evil)

    def logged() -> str | None:
        text = rel_server.log_path.read_text(errors="replace")
        return text if escaped in text else None

    log = wait_until(logged, 10, "the refused Hello's log line")
    assert not [ln for ln in log.splitlines() if ln.startswith("2099-01-01")]
    assert f"job={escaped}" in log
