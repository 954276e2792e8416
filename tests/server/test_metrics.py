"""``GET /metrics`` by Prometheus' conventions, scraped from a real server while jobs stream.

Two jobs stream over the raw protocol: one reads a whole epoch and says Bye (it finishes), the
other stops mid-epoch and goes away (it goes idle). The exposition is parsed with
prometheus_client's own parser; ``promtool check metrics`` lints it where promtool is
installed; and a real Prometheus server scrapes it where that is installed (Debian package
``prometheus``), so the labels are checked as Prometheus stores them.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from shardserve.proto.messages import Bye, ClientStats, Credit, Heartbeat, Welcome
from tests.server.rawclient import Batch, RawStream, zmq_context
from tests.support.server import ServerProc, free_port, job_status, make_job, run_server
from tests.support.slowness import scaled

IDLE_AFTER_S = 1.0
BATCH = 100  # 1000 samples: 10 batches per epoch
PER_JOB = {
    "shardserve_job_batches_sent_total",
    "shardserve_job_bytes_sent_total",
    "shardserve_client_wait_seconds_total",
    "shardserve_client_compute_seconds_total",
}


def scrape(srv: ServerProc) -> tuple[str, dict[str, list[Sample]]]:
    r = httpx.get(f"{srv.http_url}/metrics", headers=srv.headers, timeout=scaled(10))
    assert r.status_code == 200, r.text
    samples: dict[str, list[Sample]] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s)
    return r.text, samples


def value(samples: dict[str, list[Sample]], name: str, **labels: str) -> float:
    got = [
        s.value
        for s in samples.get(name, [])
        if all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(got) == 1, f"{name}{labels}: {got} in {sorted(samples)}"
    return got[0]


def wait_for_state(srv: ServerProc, job: str, state: str, timeout: float | None = None) -> None:
    timeout = scaled(15.0) if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while (got := job_status(srv, job)["state"]) != state:
        assert time.monotonic() < deadline, f"job {job} is {got!r}, never became {state!r}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(cifar_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    state = tmp_path_factory.mktemp("state")
    args = ("--state-dir", str(state), "--idle-after-s", str(IDLE_AFTER_S), "--heartbeat-s", "0.2")
    with run_server(cifar_store, *args) as srv:
        yield srv


def test_series_follow_conventions_and_ended_jobs_disappear(server: ServerProc) -> None:
    """Per-job counters carry job_id and rank (never job), count what was sent and reported, no _created series exist, and a finished job's series vanish while an idle one's stay."""
    done_job = make_job(server, batch_size=BATCH, seed=1)
    idle_job = make_job(server, batch_size=BATCH, seed=2)
    with zmq_context() as ctx:
        done, idle = RawStream(ctx, server.tcp_endpoint), RawStream(ctx, server.tcp_endpoint)
        done.hello(done_job, credit=2)
        done.recv_kind(Welcome)
        batches, _ = done.read_epoch()
        # The client's loop clock, cumulative, as a real Loader reports it on its Credits.
        done.send(
            Credit(grant=0, stats=ClientStats(batches=len(batches), wait_s=1.5, compute_s=4.5))
        )
        idle.hello(idle_job, credit=2)
        idle.recv_kind(Welcome)
        got = [idle.recv_kind(Batch) for _ in range(2)]
        idle.send(Heartbeat(stats=ClientStats(batches=2, wait_s=0.5, compute_s=0.25)))
        # A new Loader on the same rank restarts its numbers: the counter must not go down.
        idle.send(Heartbeat(stats=ClientStats(batches=1, wait_s=0.125, compute_s=0.0)))
        deadline = time.monotonic() + scaled(10)
        while True:
            text, samples = scrape(server)
            waits = {
                s.labels.get("job_id"): s.value
                for s in samples.get("shardserve_client_wait_seconds_total", [])
            }
            if waits.get(done_job) == 1.5 and waits.get(idle_job) == 0.625:
                break
            assert time.monotonic() < deadline, f"client reports never reached /metrics: {waits}"
            time.sleep(0.05)

        assert "_created" not in text, "created series are noise and must be off"
        for name, ss in samples.items():
            for s in ss:
                assert "job" not in s.labels, (
                    f"{name} has a 'job' label, which Prometheus owns: {s}"
                )
                assert "exported_job" not in s.labels
        for name in PER_JOB:
            assert name in samples, f"{name} missing from /metrics"
            assert all(set(s.labels) == {"job_id", "rank"} for s in samples[name]), samples[name]
        assert (
            value(samples, "shardserve_job_batches_sent_total", job_id=done_job, rank="0")
            == len(batches)
            == 10
        )
        nbytes = sum(p.nbytes for b in batches for p in b.header.parts)
        assert (
            value(samples, "shardserve_job_bytes_sent_total", job_id=done_job, rank="0") == nbytes
        )
        assert (
            value(samples, "shardserve_client_compute_seconds_total", job_id=done_job, rank="0")
            == 4.5
        )
        assert (
            value(samples, "shardserve_client_compute_seconds_total", job_id=idle_job, rank="0")
            == 0.25
        )
        assert value(
            samples, "shardserve_job_batches_sent_total", job_id=idle_job, rank="0"
        ) >= len(got)
        assert value(samples, "shardserve_job_ranks_connected", job_id=done_job) == 1
        assert value(samples, "shardserve_jobs", state="running") == 2
        assert value(samples, "shardserve_batches_sent_total") >= 12

        done.send(Bye())
        idle.close()  # a trainer that died mid-epoch: no Bye
        done.close()
        wait_for_state(server, done_job, "finished", timeout=IDLE_AFTER_S + 15)
        wait_for_state(server, idle_job, "idle", timeout=IDLE_AFTER_S + 15)

    _, samples = scrape(server)
    for name in PER_JOB:
        jobs = {s.labels["job_id"] for s in samples.get(name, [])}
        assert done_job not in jobs, f"{name} still exports finished job {done_job}"
        assert idle_job in jobs, f"{name} dropped idle job {idle_job}, which may come back"
    assert value(samples, "shardserve_jobs", state="finished") == 1
    assert value(samples, "shardserve_jobs", state="idle") == 1
    assert value(samples, "shardserve_jobs", state="running") == 0
    r = httpx.delete(
        f"{server.http_url}/v1/jobs/{idle_job}", headers=server.headers, timeout=scaled(10)
    )
    assert r.status_code == 200, r.text
    _, samples = scrape(server)
    assert not any(s.labels.get("job_id") == idle_job for ss in samples.values() for s in ss)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_exposition(server: ServerProc) -> None:
    """`promtool check metrics` (Prometheus' own linter) finds no problem in /metrics."""
    make_job(server, batch_size=BATCH, seed=3)
    text, _ = scrape(server)
    out = subprocess.run(
        ["promtool", "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=scaled(30),
    )
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), (
        f"promtool: rc={out.returncode}\n{out.stdout}\n{out.stderr}"
    )


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed")
def test_a_real_prometheus_stores_job_id_and_keeps_its_own_job_label(
    server: ServerProc, tmp_path: Path
) -> None:
    """A real Prometheus scraping the server stores per-job series with job_id and its own scrape job label (no exported_job)."""
    jid = make_job(server, batch_size=BATCH, seed=4)
    port = free_port()
    host = server.http_url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: shardserve-test\n    static_configs: [{{targets: ['{host}']}}]\n"
    )
    with zmq_context() as ctx:
        s = RawStream(ctx, server.tcp_endpoint)
        s.hello(jid, credit=2)
        s.recv_kind(Welcome)
        s.recv_kind(Batch)
        s.send(Heartbeat(stats=ClientStats(batches=1, wait_s=0.5, compute_s=1.0)))
        log = (tmp_path / "prometheus.log").open("wb")
        prom = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + scaled(60)
            result: list[dict[str, Any]] = []
            while not result:
                assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "Prometheus never stored the series"
                time.sleep(0.5)
                try:
                    r = httpx.get(
                        f"http://127.0.0.1:{port}/api/v1/query",
                        params={"query": f'shardserve_client_wait_seconds_total{{job_id="{jid}"}}'},
                        timeout=scaled(5),
                    )
                except httpx.TransportError:
                    continue
                if r.status_code == 200:
                    result = r.json()["data"]["result"]
            (series,) = result
            labels = series["metric"]
            assert labels["job"] == "shardserve-test", labels
            assert labels["job_id"] == jid and labels["rank"] == "0", labels
            assert "exported_job" not in labels, labels
            assert float(series["value"][1]) == 0.5
        finally:
            prom.terminate()
            prom.wait(timeout=scaled(15))
            log.close()
            s.close()


def test_a_job_of_many_ranks_exports_one_series_for_all_of_them(server: ServerProc) -> None:
    """A job of world size above RANK_SERIES_MAX (64) exports each per-rank counter once,
    labelled rank="all" and summed over its ranks, whatever the number of ranks that streamed;
    a small job keeps one series a rank."""
    from shardserve.server.runtime.metrics import RANK_SERIES_MAX

    big = make_job(server, batch_size=10, seed=3, world_size=RANK_SERIES_MAX + 1)
    small = make_job(server, batch_size=10, seed=3, world_size=2)
    with zmq_context() as ctx:
        sent: dict[str, int] = {big: 0, small: 0}
        for job, ranks in ((big, (0, 7, 64)), (small, (0, 1))):
            for rank in ranks:
                peer = RawStream(ctx, server.tcp_endpoint)
                peer.hello(job, rank=rank, credit=2)
                peer.recv_kind(Welcome)
                peer.recv_kind(Batch)
                sent[job] += 1
                peer.send(Bye())
                peer.close()
        deadline = time.monotonic() + 10
        while True:
            _, samples = scrape(server)
            rows = samples.get("shardserve_job_batches_sent_total", [])
            mine = {(s.labels["job_id"], s.labels["rank"]): s.value for s in rows}
            if mine.get((big, "all"), 0) >= sent[big] and mine.get((small, "1"), 0) >= 1:
                break
            assert time.monotonic() < deadline, f"never counted: {mine}"
            time.sleep(0.05)
    for name in PER_JOB:
        assert {s.labels["rank"] for s in samples[name] if s.labels["job_id"] == big} == {"all"}
        assert {s.labels["rank"] for s in samples[name] if s.labels["job_id"] == small} == {
            "0",
            "1",
        }
