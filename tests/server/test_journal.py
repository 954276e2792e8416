"""The job journal across real server processes: one writer, bad lines skipped, the cap kept."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from shardserve.proto.jobs import JobSpec, job_id
from tests.support.server import make_job, run_server
from tests.support.slowness import scaled


def _journal_line(job: JobSpec, **over: object) -> str:
    rec = {
        "op": "create",
        "id": job_id(job),
        "spec": job.model_dump(mode="json"),
        "num_samples": 1000,
    }
    return json.dumps({**rec, **over})


def test_second_server_on_the_same_state_neither_adopts_nor_writes_the_journal(
    cifar_store: Path, tmp_path: Path
) -> None:
    """A second server on the first one's journal warns (naming the holder's pid and --state-dir), sees none of its jobs, never writes the file, and says so on its page; once the first dies, a new server takes the journal over."""
    state = tmp_path / "state"
    with run_server(cifar_store, "--state-dir", str(state)) as first:
        jid = make_job(first, seed=11)
        before = (state / "jobs.jsonl").read_bytes()
        with run_server(cifar_store, "--state-dir", str(state)) as second:
            warned = [ln for ln in second.log_tail().splitlines() if "journal.unavailable" in ln]
            assert len(warned) == 1 and " WARNING " in warned[0], second.log_tail()
            assert f"pid {first.proc.pid}" in warned[0] and "--state-dir" in warned[0], warned
            assert httpx.get(f"{second.http_url}/v1/jobs", timeout=scaled(10)).json() == []
            other = make_job(second, seed=12)
            r = httpx.put(
                f"{second.http_url}/v1/jobs/{other}/epoch", json={"epoch": 4}, timeout=scaled(10)
            )
            assert r.status_code == 200, r.text
            assert "not journaled" in httpx.get(f"{second.http_url}/", timeout=scaled(10)).text
        assert (state / "jobs.jsonl").read_bytes() == before, "the second server wrote the journal"
        assert httpx.get(f"{first.http_url}/v1/jobs/{jid}", timeout=scaled(10)).status_code == 200
        first.kill()  # kill -9: the kernel drops the lock with the process
    with run_server(cifar_store, "--state-dir", str(state)) as again:
        assert [
            j["id"] for j in httpx.get(f"{again.http_url}/v1/jobs", timeout=scaled(10)).json()
        ] == [jid]
        assert "journal.unavailable" not in again.log_tail()


def test_invalid_journal_lines_are_skipped_with_one_log_line_each(
    cifar_store: Path, tmp_path: Path
) -> None:
    """A numeric id, a bad spec, a torn line and garbage are each skipped with one log line; every route still answers."""
    state = tmp_path / "state"
    state.mkdir()
    good = JobSpec(dataset="cifar", batch_size=10)
    lines = [
        _journal_line(good),
        _journal_line(JobSpec(dataset="cifar", batch_size=11), id=12345),  # a hand edit
        _journal_line(good, spec={"dataset": "cifar", "batch_size": -1}),
        '{"op": "epoch", "id": "' + job_id(good) + '", "epoch": "three", "seed": 0}',
        "not json at all",
        '{"op": "create", "id": "abc"',  # torn by a crash
    ]
    (state / "jobs.jsonl").write_text("\n".join(lines) + "\n")
    with run_server(cifar_store, "--state-dir", str(state)) as srv:
        jobs = httpx.get(f"{srv.http_url}/v1/jobs", timeout=scaled(10))
        assert jobs.status_code == 200, jobs.text
        assert [j["id"] for j in jobs.json()] == [job_id(good)]
        assert httpx.get(f"{srv.http_url}/", timeout=scaled(10)).status_code == 200
        make_job(srv, batch_size=12)
        skipped = [ln for ln in srv.log_tail(100_000).splitlines() if "journal.skipped_line" in ln]
        assert [int(ln.split(" line=")[1].split()[0]) for ln in skipped] == [2, 3, 4, 5, 6], skipped
        assert any("id: Input should be a valid string" in ln for ln in skipped), skipped


def test_journal_past_the_cap_loads_only_the_cap(cifar_store: Path, tmp_path: Path) -> None:
    """5,000 journaled jobs load as the 4,096 most recent, with one log line saying how many were dropped."""
    state = tmp_path / "state"
    state.mkdir()
    specs = [JobSpec(dataset="cifar", batch_size=10, seed=i) for i in range(5000)]
    (state / "jobs.jsonl").write_text("".join(_journal_line(s) + "\n" for s in specs))
    with run_server(cifar_store, "--state-dir", str(state), timeout=scaled(60)) as srv:
        ids = {j["id"] for j in httpx.get(f"{srv.http_url}/v1/jobs", timeout=scaled(30)).json()}
        assert ids == {job_id(s) for s in specs[-4096:]}
        over = [ln for ln in srv.log_tail(100_000).splitlines() if "journal.over_cap" in ln]
        assert len(over) == 1 and "dropped=904" in over[0], over
        # Replayed jobs are idle until a rank comes back, so they do not block new ones.
        r = httpx.post(
            f"{srv.http_url}/v1/jobs",
            json={"dataset": "cifar", "batch_size": 7},
            timeout=scaled(10),
        )
        assert r.status_code == 201, r.text
    # Compacted to the cap at start, then one create and the eviction's delete appended.
    ops = [json.loads(ln)["op"] for ln in (state / "jobs.jsonl").read_text().splitlines()]
    assert (len(ops), ops[-2:]) == (4096 + 2, ["delete", "create"]), ops[-3:]
