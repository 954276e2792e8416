"""Jobs over time on a real server: epochs move only by PUT, idle jobs expire, the cap counts live jobs,
and a stream that falls back from shared memory says so once."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from shardserve.proto.messages import Bye, Hello, Welcome
from tests.server.rawclient import Batch, RawStream, zmq_context
from tests.support.server import ServerProc, job_status, make_job, run_server
from tests.support.slowness import scaled


def _wait_state(srv: ServerProc, job: str, state: str, timeout: float | None = None) -> None:
    timeout = scaled(15.0) if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while (got := job_status(srv, job)["state"]) != state:
        assert time.monotonic() < deadline, f"job {job} stayed {got!r}, never {state!r}"
        time.sleep(0.05)


def test_streams_never_move_the_job_epoch(cifar_store: Path, tmp_path: Path) -> None:
    """A rank streaming epoch 3 leaves the job's epoch at 0 (also after a restart), so a fresh run starts where the last one started; PUT sets it, and a Hello's own epoch always wins."""
    state = tmp_path / "state"
    with run_server(cifar_store, "--state-dir", str(state)) as srv, zmq_context() as ctx:
        jid = make_job(srv, batch_size=100)
        s = RawStream(ctx, srv.tcp_endpoint)
        s.hello(jid, epoch=3, credit=2)
        assert s.recv_kind(Welcome).epoch == 3  # type: ignore[attr-defined]
        s.read_epoch()
        s.close()
        assert job_status(srv, jid)["epoch"] == 0
        r = httpx.post(
            f"{srv.http_url}/v1/jobs",
            json={"dataset": "cifar", "batch_size": 100},
            timeout=scaled(10),
        )
        assert (r.status_code, r.json()["status"]["epoch"]) == (200, 0), r.text
    with run_server(cifar_store, "--state-dir", str(state)) as srv, zmq_context() as ctx:
        assert job_status(srv, jid)["epoch"] == 0, "a restart must not resume a stream's epoch"
        r = httpx.put(f"{srv.http_url}/v1/jobs/{jid}/epoch", json={"epoch": 5}, timeout=scaled(10))
        assert r.status_code == 200 and r.json()["epoch"] == 5, r.text
        s = RawStream(ctx, srv.tcp_endpoint)
        s.hello(jid, epoch=2, credit=1)
        welcome = s.recv_kind(Welcome)
        assert welcome.epoch == 2, welcome  # type: ignore[attr-defined]
        assert s.recv_kind(Batch).header.epoch == 2  # type: ignore[attr-defined]
        s.close()
        assert job_status(srv, jid)["epoch"] == 5


def test_idle_jobs_expire_and_only_live_jobs_count_against_the_cap(
    cifar_store: Path, tmp_path: Path
) -> None:
    """At --max-jobs live jobs a new spec is refused with the flag named; once one goes idle it is evicted for the new one; a job idle past --job-ttl-s is forgotten and journaled as deleted."""
    state = tmp_path / "state"
    args = ("--state-dir", str(state), "--max-jobs", "2", "--idle-after-s", "2")
    with (
        run_server(cifar_store, *args, "--job-ttl-s", "3", "--heartbeat-s", "0.2") as srv,
        zmq_context() as ctx,
    ):
        a = make_job(srv, batch_size=100, seed=1)
        b = make_job(srv, batch_size=100, seed=2)
        s = RawStream(ctx, srv.tcp_endpoint)
        s.hello(a, credit=1)
        s.recv_kind(Welcome)
        r = httpx.post(
            f"{srv.http_url}/v1/jobs",
            json={"dataset": "cifar", "batch_size": 50},
            timeout=scaled(10),
        )
        if r.status_code == 201:  # b went idle already on a slow machine: nothing to refuse
            assert job_status(srv, b)["state"] == "idle"
        else:
            assert r.status_code == 422 and "--max-jobs" in r.json()["detail"], r.text
            _wait_state(srv, b, "idle")
            c = make_job(srv, batch_size=50)
            assert job_status(srv, c)["state"] == "pending"
        assert httpx.get(f"{srv.http_url}/v1/jobs/{b}", timeout=scaled(10)).status_code == 404
        assert job_status(srv, a)["state"] == "running"  # a streaming job is never evicted
        s.close()
        deadline = time.monotonic() + scaled(20)
        while a in {
            j["id"] for j in httpx.get(f"{srv.http_url}/v1/jobs", timeout=scaled(10)).json()
        }:
            assert time.monotonic() < deadline, "an idle job outlived --job-ttl-s"
            time.sleep(0.2)
        assert "job.deleted" in srv.log_tail(100_000) and "expired after 3 s" in srv.log_tail()
    journal = (state / "jobs.jsonl").read_text()
    assert f'{{"op":"delete","id":"{a}"}}' in journal


def test_shm_fallback_is_logged_once_per_job_and_shown(cifar_store: Path, tmp_path: Path) -> None:
    """Same-host streams refused a ring (limit too small) log transport=socket, one shm.fallback warning per job, and report the reason in the job status and on the page."""
    with (
        run_server(cifar_store, "--state-dir", str(tmp_path), "--shm-limit-bytes", "1KiB") as srv,
        zmq_context() as ctx,
    ):
        boot_id = httpx.get(f"{srv.http_url}/v1/info", timeout=scaled(10)).json()["boot_id"]
        jid = make_job(srv, batch_size=100, world_size=2)
        streams = []
        for rank in (0, 1):
            # One client a rank (a second one would be refused RankInUse while this one lives).
            s = RawStream(ctx, srv.tcp_endpoint)
            streams.append(s)
            for epoch in (0, 1):
                s.send(Hello(job=jid, rank=rank, epoch=epoch, credit=1, boot_id=boot_id))
                welcome = s.recv_kind(Welcome)
                assert welcome.transport == "socket", welcome  # type: ignore[attr-defined]
                s.recv_kind(Batch)
        log = srv.log_tail(200_000).splitlines()
        warned = [ln for ln in log if "shm.fallback" in ln and " WARNING " in ln]
        assert len(warned) == 1, warned
        opened = [ln for ln in log if "stream.opened" in ln]
        assert len(opened) == 4 and all("transport=socket asked=shm" in ln for ln in opened), opened
        ranks = job_status(srv, jid)["ranks"]
        assert all(r["transport"] == "socket" and "limit" in r["shm_fallback"] for r in ranks), (
            ranks
        )
        page = httpx.get(f"{srv.http_url}/", timeout=scaled(10)).text
        assert "shm fallback" in page and "shared memory fallback" in page
        metrics = httpx.get(f"{srv.http_url}/metrics", timeout=scaled(10)).text
        assert "shardserve_shm_fallbacks_total 4.0" in metrics
        for s in streams:
            s.close()


def test_two_fresh_runs_on_a_running_server_get_identical_batches(server: ServerProc) -> None:
    """The same script run twice (two passes, no set_epoch) against a server kept running streams the same batches both times: the first run's epochs do not become the second's start."""
    from shardserve.client import Loader

    def run() -> list[list[int]]:
        with Loader(server.http_url, dataset="cifar", batch_size=100, seed=21) as loader:
            return [
                b["label"].tolist() + b["image"][:, 0, 0, :4].flatten().tolist()
                for _ in range(2)
                for b in loader
            ]

    first, second = run(), run()
    assert len(first) == 20 and first[:10] != first[10:], "the two passes should be two epochs"
    assert first == second


def test_the_page_says_waiting_for_ranks_while_no_rank_is_connected(cifar_store: Path) -> None:
    """A live job none of whose ranks holds a stream (its only rank said Bye; the job stays
    running for --idle-after-s) is shown as "waiting for ranks", not "running"."""
    with (
        run_server(cifar_store, "--idle-after-s", "3600") as srv,
        zmq_context() as ctx,
    ):
        jid = make_job(srv, batch_size=100, world_size=2)
        s = RawStream(ctx, srv.tcp_endpoint)
        s.hello(jid, rank=0, credit=1)
        s.recv_kind(Welcome)
        s.send(Bye())
        deadline = time.monotonic() + scaled(15.0)
        status = job_status(srv, jid)
        while any(r["connected"] for r in status["ranks"]):
            assert time.monotonic() < deadline, f"rank 0 still connected after Bye: {status}"
            time.sleep(0.05)
            status = job_status(srv, jid)
        s.close()
        assert status["state"] == "running", status  # the lifecycle state is unchanged
        page = httpx.get(f"{srv.http_url}/", timeout=scaled(10)).text
        (head,) = [ln for ln in page.splitlines() if f"id='job-{jid}'" in ln]
        assert ">waiting for ranks</span>" in head and ">running<" not in head, head
        assert "0 of 2 ranks" in page
