"""Streaming processes (``--stream-processes 2``): the same batches as one process, exactly
once across a killed process, counters summed, clients that never ask served by the main one."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from shardserve.client import Loader
from shardserve.proto.errors import ShardserveError
from shardserve.proto.messages import EndOfEpoch, Error, Welcome
from shardserve.server.planning import plan
from tests.server.rawclient import RawStream, zmq_context
from tests.support.data import make_cifar_like, sample_id_of
from tests.support.server import ServerProc, free_port, job_status, make_job, run_server
from tests.support.slowness import scaled

BATCH = 20
N = 600
#: The test transforms (``fail_on``), loaded by the main process and every streaming one.
TEST_TRANSFORMS = ("--transforms", "tests.transforms.mods")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procs")
    make_cifar_like(root, "cifar", n=N)
    make_cifar_like(root, "cifar2", n=N // 2, seed=1)
    return root


@pytest.fixture(scope="module")
def one(store: Path) -> Iterator[ServerProc]:
    with run_server(store) as srv:
        yield srv


@pytest.fixture(scope="module")
def two(store: Path) -> Iterator[ServerProc]:
    with run_server(
        store, "--stream-processes", "2", "--heartbeat-s", "0.5", *TEST_TRANSFORMS
    ) as srv:
        yield srv


def processes(srv: ServerProc) -> list[dict[str, Any]]:
    r = httpx.get(f"{srv.http_url}/v1/processes", headers=srv.headers, timeout=scaled(30))
    assert r.status_code == 200, r.text
    return list(r.json())


@contextmanager
def all_closed(loaders: list[Loader]) -> Iterator[list[Loader]]:
    """``loaders``, each closed when the block ends, passed or failed."""
    try:
        yield loaders
    finally:
        for ld in loaders:
            ld.close()


def placed(srv: ServerProc) -> dict[int, int]:
    """Ranks placed on each streaming process."""
    return {p["index"]: p["ranks"] for p in processes(srv)}


def added(before: dict[int, int], after: dict[int, int]) -> list[int]:
    """Ranks placed on each process since ``before``, sorted."""
    return sorted(after[k] - before.get(k, 0) for k in after)


def counter(srv: ServerProc, name: str) -> float:
    text = httpx.get(f"{srv.http_url}/metrics", headers=srv.headers, timeout=scaled(30)).text
    values = re.findall(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert len(values) == 1, f"{name} appears {len(values)} times in /metrics"
    return float(values[0])


def await_true(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not check():
        assert time.monotonic() < deadline, f"waited {scaled(timeout):.0f} s for {what}"
        time.sleep(0.05)  # polling a condition with a deadline


def batches(
    srv: ServerProc, world: int, dataset: Any = "cifar", seed: int = 7, **kw: Any
) -> dict[int, list[dict[str, np.ndarray]]]:
    """Every rank's epoch 0, read one rank after another."""
    out = {}
    for rank in range(world):
        with Loader(
            srv.http_url, dataset, BATCH, rank=rank, world_size=world, seed=seed, **kw
        ) as ld:
            out[rank] = [arrays(b) for b in ld]
    return out


def arrays(batch: Any) -> dict[str, np.ndarray]:
    """A batch's parts as arrays (a step of several environments: ``env.part``)."""
    if isinstance(batch, list):
        return {f"{e}.{k}": v for e, b in enumerate(batch) for k, v in arrays(b).items()}
    return {k: v.numpy().copy() for k, v in batch.items()}


def same(
    a: dict[int, list[dict[str, np.ndarray]]], b: dict[int, list[dict[str, np.ndarray]]]
) -> None:
    assert a.keys() == b.keys()
    for rank in a:
        assert len(a[rank]) == len(b[rank]) > 0, rank
        for x, y in zip(a[rank], b[rank], strict=True):
            assert x.keys() == y.keys()
            for k in x:
                np.testing.assert_array_equal(x[k], y[k], err_msg=f"rank {rank} part {k}")


def test_two_ranks_on_two_processes_read_what_one_process_serves(
    one: ServerProc, two: ServerProc
) -> None:
    """Two ranks open at once land on both streaming processes and get one process's bytes."""
    before = placed(two)
    with all_closed(
        [Loader(two.http_url, "cifar", BATCH, rank=r, world_size=2, seed=7) for r in range(2)]
    ) as loaders:
        its = [iter(ld) for ld in loaders]
        got: dict[int, list[dict[str, np.ndarray]]] = {0: [], 1: []}
        for r, it in enumerate(its):
            got[r].append(arrays(next(it)))
        assert added(before, placed(two)) == [1, 1]
        for r, it in enumerate(its):
            got[r].extend(arrays(b) for b in it)
    same(got, batches(one, 2))
    ids = np.concatenate([b["label"] for r in got for b in got[r]])
    assert ids.size == N
    page = httpx.get(f"{two.http_url}/", headers=two.headers, timeout=scaled(30)).text
    section = page.split("id='processes'", 1)[1].split("</table>", 1)[0]
    for p in processes(two):
        assert f"<tr><td>{p['index']}</td><td>{p['pid']}</td><td>up</td>" in section


def test_killed_streaming_process_resumes_every_rank_exactly_once(
    one: ServerProc, two: ServerProc
) -> None:
    """SIGKILL of a streaming process mid-epoch: each rank still gets its batches once, in order."""
    want = batches(one, 2, seed=8)
    before = placed(two)
    with all_closed(
        [Loader(two.http_url, "cifar", BATCH, rank=r, world_size=2, seed=8) for r in range(2)]
    ) as loaders:
        its = [iter(ld) for ld in loaders]
        got: dict[int, list[dict[str, np.ndarray]]] = {0: [], 1: []}
        for _ in range(3):
            for r, it in enumerate(its):
                got[r].append(arrays(next(it)))
        assert added(before, placed(two)) == [1, 1]
        victim = processes(two)[0]
        os.kill(victim["pid"], signal.SIGKILL)
        for r, it in enumerate(its):
            got[r].extend(arrays(b) for b in it)
    same(got, want)
    await_true(
        f"process {victim['index']} to be replaced",
        lambda: any(
            p["index"] == victim["index"] and p["up"] and p["restarts"] == victim["restarts"] + 1
            for p in processes(two)
        ),
    )


def test_counters_are_summed_and_never_go_down(two: ServerProc) -> None:
    """/metrics counts every batch the processes sent, and keeps a killed process's counts."""
    start = counter(two, "shardserve_batches_sent_total")
    with Loader(two.http_url, "cifar", BATCH, rank=0, world_size=1, seed=9) as ld:
        n = sum(1 for _ in ld)
    await_true(
        f"batches_sent_total to grow by the {n} batches read",
        lambda: counter(two, "shardserve_batches_sent_total") >= start + n,
    )
    seen = counter(two, "shardserve_batches_sent_total")
    assert seen == start + n
    victim = next(p for p in processes(two) if p["up"])
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + scaled(30)
    while not any(p["restarts"] > victim["restarts"] and p["up"] for p in processes(two)):
        assert counter(two, "shardserve_batches_sent_total") >= seen, "a counter went down"
        assert time.monotonic() < deadline, "the killed process was not replaced"
    assert counter(two, "shardserve_batches_sent_total") == seen


def test_client_that_never_asks_is_served_by_the_main_process(two: ServerProc) -> None:
    """A protocol-3 client saying Hello to the endpoint it knows reads the epoch from the main process."""
    job = make_job(two, batch_size=BATCH)
    with zmq_context() as ctx:
        raw = RawStream(ctx, two.tcp_endpoint)
        raw.hello(job)
        welcome = raw.recv_kind(Welcome)
        got, end = raw.read_epoch()
        raw.close()
    assert isinstance(end, EndOfEpoch)
    assert len(got) == welcome.num_batches == N // BATCH
    assert welcome.stream < 1 << 26  # the main process's own stream ids


@pytest.mark.parametrize(
    "kw",
    [
        {"envs": 2},
        {"transforms": [{"name": "hflip"}]},
        {"dataset": {"cifar": 0.5, "cifar2": 0.5}},
    ],
    ids=["envs", "transforms", "mixture"],
)
def test_jobs_of_every_kind_read_alike_over_processes(
    one: ServerProc, two: ServerProc, kw: dict[str, Any]
) -> None:
    """Environments, a transform chain and a mixture give the same batches with streaming processes."""
    same(batches(two, 2, **kw), batches(one, 2, **kw))


def test_share_group_stays_in_one_process(one: ServerProc, two: ServerProc) -> None:
    """Two subscribers of one shared rank are placed together and both get the unshared bytes."""
    want = batches(one, 1)
    before = placed(two)
    with all_closed(
        [
            Loader(two.http_url, "cifar", BATCH, rank=0, world_size=1, seed=7, share="procs")
            for _ in range(2)
        ]
    ) as subs:
        its = [iter(s) for s in subs]
        got = [[arrays(next(it))] for it in its]
        assert added(before, placed(two)) == [0, 1]  # one rank, so one process
        for g, it in zip(got, its, strict=True):
            g.extend(arrays(b) for b in it)
    for g in got:
        same({0: g}, want)


def test_a_seed_set_over_http_reaches_the_streaming_processes(
    one: ServerProc, two: ServerProc
) -> None:
    """An epoch after ``PUT .../epoch`` with a new seed is the one a single process serves."""

    def read(srv: ServerProc) -> list[dict[str, np.ndarray]]:
        with Loader(srv.http_url, "cifar", BATCH, rank=0, world_size=2, seed=11) as ld:
            first = [arrays(b) for b in ld]
            r = httpx.put(
                f"{srv.http_url}/v1/jobs/{ld.job_id}/epoch",
                json={"epoch": 1, "seed": 12345},
                headers=srv.headers,
                timeout=scaled(30),
            )
            assert r.status_code == 200, r.text
            ld.set_epoch(1)
            return first + [arrays(b) for b in ld]

    got, want = read(two), read(one)
    same({0: got}, {0: want})
    epoch1 = [int(i) for b in got[len(got) // 2 :] for i in sample_id_of(b)]
    for seed, equal in ((12345, True), (11, False)):
        dealt = plan(N, seed=seed, epoch=1, world_size=2, rank=0, batch_size=BATCH)
        assert ([int(i) for b in dealt for i in b] == epoch1) is equal, seed


def _serve_with_next_port_taken(store: Path) -> tuple[int, subprocess.CompletedProcess[str]]:
    """Start a 2-process server on a free port P while P + 1 is held; its port and result."""
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", port + 1))  # process 1 binds the main port + 1
        taken.listen()
        with tempfile.TemporaryDirectory(prefix="ss-") as work:
            cmd = [
                sys.executable,
                "-m",
                "shardserve.server",
                "serve",
                "--store",
                str(store),
                "--http",
                "127.0.0.1:0",
                "--data",
                f"tcp://127.0.0.1:{port}",
                "--ipc",
                f"{work}/ss.sock",
                "--stream-processes",
                "2",
            ]
            return port, subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(120))


def test_a_streaming_process_that_cannot_bind_stops_the_start(store: Path) -> None:
    """With process 1's data port taken, the server exits 1 naming that process and the port."""
    port, r = _serve_with_next_port_taken(store)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert f"tcp://127.0.0.1:{port + 1}" in out and "streaming process 1" in out, out[-3000:]


def test_a_job_failing_in_the_main_process_stops_its_ranks_in_streaming_processes(
    two: ServerProc,
) -> None:
    """Rank 0 fails the job in the main process: rank 1, in a streaming process, gets the error."""
    chain = [{"name": "fail_on", "params": {"every": N}}]  # sample 0 alone fails: rank 0's
    kw: dict[str, Any] = {"rank": 1, "world_size": 2, "shuffle": False, "transforms": chain}
    before = placed(two)
    # Batches of 2: 150 a rank, far more than the credit rank 1 can hold before the end.
    with Loader(two.http_url, "cifar", 2, timeout=scaled(20), **kw) as rank1:
        it = iter(rank1)
        next(it)
        assert added(before, placed(two)) == [0, 1]  # rank 1 streams from a streaming process
        with zmq_context() as ctx:
            raw = RawStream(ctx, two.tcp_endpoint)  # rank 0 never asks: the main process
            raw.hello(rank1.job_id, rank=0)
            raw.recv_kind(Welcome)
            while not isinstance(msg := raw.recv(what="rank 0's failure"), Error):
                raw.grant(1)
            raw.close()
        assert "fail_on" in msg.message and msg.fatal
        assert job_status(two, rank1.job_id)["state"] == "failed"
        with pytest.raises(ShardserveError, match="fail_on"):
            for _ in it:  # at most the credit already sent, then the job's error
                pass
        r = httpx.post(
            f"{two.http_url}/v1/jobs/{rank1.job_id}/place",
            json={"rank": 1},
            headers=two.headers,
            timeout=scaled(30),
        )
        assert r.status_code == 200 and r.json()["process"] == 0, r.text  # its error is there


def test_a_job_deleted_while_placed_ends_its_streams_and_is_placed_no_more(
    two: ServerProc,
) -> None:
    """DELETE ends a rank's stream in its streaming process with an error, and place then 404s."""
    before = placed(two)
    with Loader(two.http_url, "cifar", 2, rank=0, world_size=1, seed=3, timeout=scaled(20)) as ld:
        it = iter(ld)
        next(it)
        assert added(before, placed(two)) == [0, 1]
        url = f"{two.http_url}/v1/jobs/{ld.job_id}"
        assert httpx.delete(url, headers=two.headers, timeout=scaled(30)).status_code == 200
        with pytest.raises(ShardserveError, match="deleted"):
            for _ in it:  # 300 batches: the credit already sent, then the end
                pass
        r = httpx.post(f"{url}/place", json={"rank": 0}, headers=two.headers, timeout=scaled(30))
        assert r.status_code == 404, r.text
    assert placed(two) == before  # its rank no longer counts on the process
