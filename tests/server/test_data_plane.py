"""The data plane against a real server subprocess, spoken to with raw DEALER sockets."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from shardserve.proto.errors import ErrorCode
from shardserve.proto.framing import encode
from shardserve.proto.messages import (
    MAX_CREDIT,
    PROTOCOL_VERSION,
    Bye,
    EndOfEpoch,
    Error,
    Heartbeat,
    Hello,
    Reject,
    Welcome,
)
from shardserve.server.planning import RankPlan, epoch_order
from shardserve.server.store.catalog import Store
from tests.server.conftest import CIFAR_N
from tests.server.rawclient import Batch, RawStream, zmq_context
from tests.support.data import sample_id_of
from tests.support.server import ServerProc, job_status, make_job
from tests.support.slowness import scaled

#: What every message's header frame starts with: the magic and this protocol's version.
HEAD = b"SS" + bytes([PROTOCOL_VERSION])


def planned(
    store: Path, seed: int, epoch: int, world_size: int, rank: int, batch_size: int
) -> RankPlan:
    ds = Store(store).open("cifar")
    order = epoch_order(ds.num_samples, seed, epoch, "global", shard_rows=ds.shard_rows)
    return RankPlan.from_order(order, world_size, rank, batch_size, drop_last=False)


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_whole_epoch_one_rank_matches_take_of_plan(
    server: ServerProc, cifar_store: Path, transport: str
) -> None:
    """One rank reads a whole epoch: every sample once, each batch equal to take() of its planned indices."""
    job = make_job(server, seed=3, world_size=1)
    endpoint = server.tcp_endpoint if transport == "tcp" else server.ipc_endpoint
    assert endpoint is not None
    ds = Store(cifar_store).open("cifar")
    plan = planned(cifar_store, seed=3, epoch=2, world_size=1, rank=0, batch_size=64)
    with zmq_context() as ctx:
        s = RawStream(ctx, endpoint)
        s.hello(job, epoch=2, credit=4, nonce=11)
        welcome = s.recv_kind(Welcome)
        assert (welcome.nonce, welcome.num_batches, welcome.seed, welcome.transport) == (
            11,
            len(plan),
            3,
            "socket",
        )
        batches, eoe = s.read_epoch()
        assert eoe.num_batches == len(plan) == len(batches)
        for i, b in enumerate(batches):
            assert (b.header.index, b.header.stream, b.header.epoch) == (i, welcome.stream, 2)
            expect = ds.take(plan.batch(i))
            assert b.parts.keys() == expect.keys()
            for name in expect:
                np.testing.assert_array_equal(b.parts[name], expect[name])
        ids = np.concatenate([sample_id_of(b.parts) for b in batches])
        assert np.array_equal(np.sort(ids), np.arange(CIFAR_N))
        s.send(Bye())
        s.close()


def test_three_ranks_cover_every_sample_once(server: ServerProc, cifar_store: Path) -> None:
    """Three ranks of one job together deliver every sample, each rank exactly its plan (plus DistributedSampler padding)."""
    job = make_job(server, seed=5, world_size=3, batch_size=50)
    seen = []
    with zmq_context() as ctx:
        streams = [RawStream(ctx, server.tcp_endpoint) for _ in range(3)]
        for rank, s in enumerate(streams):
            s.hello(job, rank=rank, epoch=0, credit=3)
        for s in streams:
            s.recv_kind(Welcome)
        for rank, s in enumerate(streams):
            batches, _ = s.read_epoch()
            plan = planned(cifar_store, seed=5, epoch=0, world_size=3, rank=rank, batch_size=50)
            ids = np.concatenate([sample_id_of(b.parts) for b in batches])
            assert np.array_equal(ids, np.concatenate([plan.batch(i) for i in range(len(plan))]))
            seen.append(ids)
            s.close()
    all_ids = np.concatenate(seen)
    padding = -(-CIFAR_N // 3) * 3 - CIFAR_N
    assert len(all_ids) == CIFAR_N + padding
    assert np.array_equal(np.unique(all_ids), np.arange(CIFAR_N))


def test_unconsumed_stream_holds_no_more_than_its_credit(server: ServerProc) -> None:
    """A stream granted 2 batches gets exactly 2 and no more until it grants again."""
    job = make_job(server, seed=9, batch_size=100)
    with zmq_context() as ctx:
        s = RawStream(ctx, server.tcp_endpoint)
        s.hello(job, credit=2)
        s.recv_kind(Welcome)
        first = [s.recv_kind(Batch), s.recv_kind(Batch)]
        assert [b.header.index for b in first] == [0, 1]
        assert s.drain_until_heartbeat() == []
        rank = job_status(server, job)["ranks"][0]
        assert (rank["next_batch"], rank["credit"], rank["batches_delivered"]) == (2, 0, 2)
        s.grant(3)
        more = [s.recv_kind(Batch) for _ in range(3)]
        assert [b.header.index for b in more] == [2, 3, 4]
        assert s.drain_until_heartbeat() == []
        assert job_status(server, job)["ranks"][0]["next_batch"] == 5
        s.close()


def test_resume_from_start_batch_and_replace_stream(server: ServerProc) -> None:
    """A new Hello on the same socket replaces the stream; it resumes at start_batch with a new stream id."""
    job = make_job(server, seed=1, batch_size=100)
    with zmq_context() as ctx:
        s = RawStream(ctx, server.tcp_endpoint)
        s.hello(job, credit=2, nonce=1)
        w1 = s.recv_kind(Welcome)
        s.hello(job, credit=2, nonce=2, start_batch=7)
        w2 = None
        while w2 is None:  # batches of the old stream may still be on the wire
            msg = s.recv()
            if isinstance(msg, Welcome):
                w2 = msg
            else:
                assert isinstance(msg, (Batch, Heartbeat)) and (
                    not isinstance(msg, Batch) or msg.header.stream == w1.stream
                )
        assert w2.nonce == 2 and w2.stream != w1.stream and w2.start_batch == 7
        batches, _ = s.read_epoch()
        assert [b.header.index for b in batches] == list(range(7, w2.num_batches))
        assert all(b.header.stream == w2.stream for b in batches)
        s.close()


def test_hello_refusals(server: ServerProc) -> None:
    """Rank >= world size and start past the end are Rejected with the bound; unknown jobs get a retryable JOB_NOT_FOUND."""
    job = make_job(server, world_size=2)
    with zmq_context() as ctx:
        s = RawStream(ctx, server.tcp_endpoint)
        s.hello(job, rank=2, nonce=5)
        r = s.recv_kind(Reject)
        assert r.code == ErrorCode.BAD_REQUEST and r.nonce == 5 and "0 <= rank < 2" in r.message
        s.hello(job, rank=0, start_batch=10_000)
        r = s.recv_kind(Reject)
        assert r.code == ErrorCode.BAD_REQUEST and "start_batch" in r.message
        s.hello("0123456789abcdef")
        e = s.recv_kind(Error)
        assert e.code == ErrorCode.JOB_NOT_FOUND and not e.fatal
        s.close()


def test_protocol_version_mismatch_names_both_versions(server: ServerProc) -> None:
    """A Hello offering only other protocol versions is Rejected naming the client's and the server's versions."""
    job = make_job(server)
    with zmq_context() as ctx:
        s = RawStream(ctx, server.tcp_endpoint)
        s.hello(job, protocols=(7, 9))
        r = s.recv_kind(Reject)
        assert (
            r.code == ErrorCode.VERSION_MISMATCH
            and "[7, 9]" in r.message
            and f"[{PROTOCOL_VERSION}]" in r.message
        )
        frame = encode(Hello(job=job, rank=0, epoch=0, credit=1))[0]
        s.send_raw([frame[:2] + bytes([42]) + frame[3:]])  # the header's version byte says 42
        r = s.recv_kind(Reject)
        assert (
            r.code == ErrorCode.VERSION_MISMATCH
            and "[42]" in r.message
            and f"[{PROTOCOL_VERSION}]" in r.message
        )
        s.close()


def test_bad_input_is_answered_and_the_server_keeps_serving(server: ServerProc) -> None:
    """Garbage, unknown kinds and credit without a stream get typed errors; the same socket can then stream."""
    job = make_job(server, batch_size=500)
    with zmq_context() as ctx:
        s = RawStream(ctx, server.tcp_endpoint)
        s.send_raw([b"garbage"])
        assert s.recv_kind(Error).code == ErrorCode.MALFORMED
        s.send_raw([HEAD + b"\x63{}"])
        assert s.recv_kind(Error).code == ErrorCode.UNKNOWN_MESSAGE
        s.send_raw([HEAD + b"\x04{not json"])
        assert s.recv_kind(Error).code == ErrorCode.MALFORMED
        s.grant(1)
        e = s.recv_kind(Error)
        assert e.code == ErrorCode.UNKNOWN_STREAM and not e.fatal
        s.send(EndOfEpoch(stream=1, epoch=0, num_batches=0))
        assert s.recv_kind(Error).code == ErrorCode.UNKNOWN_MESSAGE
        s.hello(job, credit=4)
        s.recv_kind(Welcome)
        batches, _ = s.read_epoch()
        assert len(batches) == 2
        s.close()


def test_credit_over_the_limit_ends_the_stream(server: ServerProc) -> None:
    """Credit that would exceed MAX_CREDIT is refused with a fatal BAD_REQUEST, not clamped."""
    job = make_job(server, batch_size=1)
    with zmq_context() as ctx:
        s = RawStream(ctx, server.tcp_endpoint)
        # The epoch has fewer batches than a Hello's whole credit, so some of it is still owed
        # however many batches the server sent before the grant arrives (on a busy machine,
        # all of them): the grant goes over the cap whenever it is read.
        assert CIFAR_N < MAX_CREDIT
        s.hello(job, credit=MAX_CREDIT)
        s.recv_kind(Welcome)
        s.grant(MAX_CREDIT)
        while True:
            msg = s.recv(what="the credit error")
            if isinstance(msg, Error):
                break
        assert msg.code == ErrorCode.BAD_REQUEST and msg.fatal and "1024" in msg.message
        s.close()


def test_delete_job_ends_its_streams(server: ServerProc) -> None:
    """DELETE /v1/jobs/{id} ends an open stream of the job with a fatal JOB_FAILED and GET then 404s."""
    job = make_job(server, seed=77)
    with zmq_context() as ctx:
        s = RawStream(ctx, server.tcp_endpoint)
        s.hello(job, credit=1)
        s.recv_kind(Welcome)
        s.recv_kind(Batch)
        r = httpx.delete(f"{server.http_url}/v1/jobs/{job}", timeout=scaled(10))
        assert r.status_code == 200 and r.json()["state"] == "deleted"
        e = s.recv_kind(Error)
        assert e.code == ErrorCode.JOB_FAILED and e.fatal and "deleted" in e.message
        assert httpx.get(f"{server.http_url}/v1/jobs/{job}", timeout=scaled(10)).status_code == 404
        s.close()


def test_dead_client_is_shown_disconnected(server: ServerProc) -> None:
    """A client that vanishes mid-stream is reclaimed and its rank shows disconnected."""
    job = make_job(server, seed=123)
    with zmq_context() as ctx:
        s = RawStream(ctx, server.tcp_endpoint)
        s.hello(job, credit=1)
        s.recv_kind(Welcome)
        s.recv_kind(Batch)
        s.grant(1)  # the server now owes a batch to a peer about to vanish
        assert job_status(server, job)["ranks"][0]["connected"]
        s.close()
    deadline = 20.0
    import time

    t0 = time.monotonic()
    while job_status(server, job)["ranks"][0]["connected"]:
        assert time.monotonic() - t0 < deadline, (
            f"rank still connected {deadline} s after its client died"
        )
        time.sleep(0.05)
