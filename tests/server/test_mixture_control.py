"""Mixture jobs over the control plane of a real server: creation checks, the plan a mixture
job deals (shares, disjoint ranks), weight changes from a step, and the same plans after a
kill -9 and restart and on a second server. Quarantine: ``test_mixture_quarantine.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from shardserve.proto.errors import BadRequest, StepInThePast
from shardserve.proto.jobs import JobSpec, MixtureSource, WeightChange
from shardserve.server.jobs.mixtures import frontier
from shardserve.server.planning.mixture import (
    MixSource,
    Segment,
    mixture_order,
    split_ids,
)
from shardserve.server.registry.jobs import JobRegistry
from shardserve.server.store.write.writer import ShardWriter
from tests.server.mixing import (
    BATCH,
    EPOCH_SAMPLES,
    OFFSETS,
    SIZES,
    SPEC,
    STEPS,
    WEIGHTS,
    WORLD,
    global_order,
    plan,
    post_job,
    put_mixture,
    shares_ok,
    write_mix_store,
)
from tests.support.data import CIFAR_FIELDS, make_cifar_like
from tests.support.server import ServerProc, free_port, run_server
from tests.support.slowness import scaled


@pytest.fixture(scope="module")
def mix_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mix_store(tmp_path_factory.mktemp("mixstore"))


@pytest.fixture()
def srv(mix_store: Path, tmp_path: Path) -> Iterator[ServerProc]:
    with run_server(mix_store, "--state-dir", str(tmp_path / "state")) as s:
        yield s


@pytest.fixture(scope="module")
def shared_srv(mix_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server for the tests that only create jobs, read plans or are refused: none of
    them changes a job's weights or quarantines a sample (those tests get ``srv``)."""
    with run_server(mix_store, "--state-dir", str(tmp_path_factory.mktemp("state"))) as s:
        yield s


def test_mixture_plan_shares_ranks_and_the_planner(shared_srv: ServerProc) -> None:
    """A 3-source job over 2 ranks: shares within 5 sigma of the weights over 10k samples,
    equal batches, sources that do not wrap disjoint across ranks, and exactly the pure
    planner's order."""
    r = post_job(shared_srv, SPEC)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["status"]["spec"]["dataset"] == "mix:web+code+math"
    assert body["status"]["batches_per_epoch"] == STEPS
    job = body["id"]
    assert post_job(shared_srv, SPEC).json()["id"] == job  # idempotent, as every rank posts it
    ranks = [plan(shared_srv, job, r) for r in range(WORLD)]
    order = global_order(ranks)
    assert shares_ok(order, WEIGHTS)
    for name in ("web", "code"):  # fewer draws than samples: each sample at most once
        k = list(SIZES).index(name)
        per_rank = [
            set(
                split_ids(p.reshape(-1), OFFSETS)[1][
                    split_ids(p.reshape(-1), OFFSETS)[0] == k
                ].tolist()
            )
            for p in ranks
        ]
        assert not per_rank[0] & per_rank[1]
    expected = mixture_order(
        [MixSource(n) for n in SIZES.values()],
        11,
        0,
        EPOCH_SAMPLES,
        [Segment(0, WEIGHTS)],
        world_size=WORLD,
    )
    assert np.array_equal(order, expected)


def test_weight_change_from_step_k_and_restart(mix_store: Path, tmp_path: Path) -> None:
    """A change at step k leaves steps < k on every rank as they were and steps >= k follow
    the new weights; the same plans and schedule after kill -9 and a restart, and on a second
    server given the same spec and change."""
    k = 40
    new = {"web": 0.1, "code": 0.1, "math": 0.8}
    http, data = free_port(), free_port()
    state = tmp_path / "state"
    with run_server(mix_store, "--state-dir", str(state), http_port=http, data_port=data) as a:
        job = post_job(a, SPEC).json()["id"]
        before = [plan(a, job, r) for r in range(WORLD)]
        r = put_mixture(a, job, {"weights": new, "at_step": k})
        assert r.status_code == 200, r.text
        status = r.json()
        assert status["schedule"] == [
            {"at_step": 0, "weights": list(WEIGHTS)},
            {"at_step": k, "weights": [0.1, 0.1, 0.8]},
        ]
        after = [plan(a, job, r) for r in range(WORLD)]
        for b, c in zip(before, after, strict=True):
            assert np.array_equal(b[:k], c[:k])
            assert not np.array_equal(b[k:], c[k:])
        assert shares_ok(global_order([p[k:] for p in after]), (0.1, 0.1, 0.8))
        a.kill()  # kill -9
        a.proc.wait(timeout=scaled(30))
        with run_server(
            mix_store, "--state-dir", str(state), http_port=http, data_port=data
        ) as restarted:
            r = put_mixture(restarted, job, {"weights": [1, 1, 1]})  # frontier unknown
            assert r.status_code == 409 and "name at_step" in r.text
            assert (
                put_mixture(restarted, job, {"weights": [1, 1, 1], "at_step": 10**6}).status_code
                == 200
            )
            again = [plan(restarted, job, r) for r in range(WORLD)]
            got = httpx.get(
                f"{restarted.http_url}/v1/jobs/{job}/mixture",
                headers=restarted.headers,
                timeout=scaled(10),
            ).json()
            assert got["schedule"][:2] == status["schedule"]
    for c, d in zip(after, again, strict=True):
        assert c.tobytes() == d.tobytes()
    with run_server(mix_store, "--state-dir", str(tmp_path / "other")) as second:
        assert post_job(second, SPEC).json()["id"] == job
        assert (
            put_mixture(second, job, {"weights": [0.1, 0.1, 0.8], "at_step": k}).status_code == 200
        )
        for r, c in enumerate(after):
            assert plan(second, job, r).tobytes() == c.tobytes()


def test_mixture_update_refusals(shared_srv: ServerProc) -> None:
    """Weights that name an unknown source, miss one, or sum to 0 are 422s saying so; a
    single-dataset job has no mixture to steer."""
    job = post_job(shared_srv, SPEC).json()["id"]
    r = put_mixture(shared_srv, job, {"weights": {"web": 1, "code": 1, "nope": 1}})
    assert r.status_code == 422 and "unknown ['nope']" in r.text and "missing ['math']" in r.text
    r = put_mixture(shared_srv, job, {"weights": [0, 0, 0]})
    assert r.status_code == 422 and "at least one weight" in r.text
    r = put_mixture(shared_srv, job, {"weights": [1, 1]})
    assert r.status_code == 422 and "2 weights for 3 sources" in r.text
    single = post_job(shared_srv, {"dataset": "web", "batch_size": 8}).json()["id"]
    r = put_mixture(shared_srv, single, {"weights": [1]})
    assert r.status_code == 422 and "not a mixture" in r.text


def test_the_status_page_shows_weights_for_a_mixture_job_only(shared_srv: ServerProc) -> None:
    """The page asks each job's kind for its weights: a mixture job shows its line, a job of
    one dataset none."""
    mix = post_job(shared_srv, SPEC).json()["id"]
    single = post_job(shared_srv, {"dataset": "web", "batch_size": 8}).json()["id"]
    r = httpx.get(f"{shared_srv.http_url}/", headers=shared_srv.headers, timeout=scaled(30))
    assert r.status_code == 200, r.text
    sections = {
        jid: r.text.split(f"id='job-{jid}'", 1)[1].split("<h3", 1)[0] for jid in (mix, single)
    }
    assert "class='meta mixture'" in sections[mix]
    assert "class='meta mixture'" not in sections[single]


def test_creation_refusals_name_what_to_change(shared_srv: ServerProc) -> None:
    """An unknown source is a 404 naming it; a source whose field differs is a 422 naming the
    source and field; bad weights and unsupported combinations are 422s."""
    r = post_job(
        shared_srv,
        {**SPEC, "mixture": [{"name": "web", "weight": 1}, {"name": "nope", "weight": 1}]},
    )
    assert r.status_code == 404 and "nope" in r.text
    r = post_job(
        shared_srv,
        {**SPEC, "mixture": [{"name": "web", "weight": 1}, {"name": "other", "weight": 1}]},
    )
    assert r.status_code == 422 and "'other' field 'label' is int32" in r.text
    r = post_job(shared_srv, {**SPEC, "mixture": [{"name": "web", "weight": 0}]})
    assert r.status_code == 422 and "at least one weight" in r.text
    stop = [{"name": "web", "weight": 1, "on_exhausted": "stop"}]
    r = post_job(shared_srv, {**SPEC, "mixture": stop, "envs": 2})
    assert r.status_code == 422 and "env_shuffle='split'" in r.text
    r = post_job(shared_srv, {**SPEC, "epoch_samples": 10**9})
    assert r.status_code == 422 and "epoch_samples <= " in r.text
    ok = post_job(
        shared_srv,
        {
            **SPEC,
            "mixture": [{"name": "web", "weight": 1}, {"name": "other", "weight": 1}],
            "fields": ["image"],
        },
    )
    assert ok.status_code == 201, ok.text


def test_change_in_the_past_is_refused() -> None:
    """A change before the frontier (steps some rank was sent or has in flight, within its
    epoch) raises StepInThePast naming the frontier; at the frontier it is taken."""
    from shardserve.proto.api import RankStatus

    reg = JobRegistry(None)
    spec = JobSpec(
        mixture=(MixtureSource(name="a", weight=1), MixtureSource(name="b", weight=1)),
        batch_size=4,
        world_size=2,
    )
    job, _ = reg.create(spec, 80, (40, 40))  # 10 batches per rank per epoch
    ranks = [
        RankStatus(rank=0, connected=True, epoch=1, next_batch=3, credit=2, num_batches=10),
        RankStatus(rank=1, connected=True, epoch=1, next_batch=4, credit=0, num_batches=10),
    ]
    front = frontier(job, ranks)
    assert front == 15
    # Credit a rank holds at its epoch's end reaches no step of the next epoch.
    done = RankStatus(rank=0, connected=True, epoch=1, next_batch=10, credit=4, num_batches=10)
    assert frontier(job, [done]) == 20
    with pytest.raises(StepInThePast, match="use at_step >= 15"):
        reg.set_mixture(job.id, WeightChange(at_step=14, weights=(1, 2)), front)
    job = reg.set_mixture(job.id, WeightChange(at_step=15, weights=(1, 2)), front)
    assert [c.at_step for c in job.schedule()] == [0, 15]


def test_client_steers_every_rank_the_same(srv: ServerProc) -> None:
    """Through the client's ControlClient: each DDP rank sending the same change at the step
    they agree on (the next epoch's first) records it once; the schedule, the weights in force
    and quarantine come back typed."""
    from shardserve.client.control import ControlClient
    from shardserve.client.mixture import mixture_sources, next_epoch_step

    spec = JobSpec(
        mixture=mixture_sources({"web": 0.5, "code": 0.3, "math": 0.2}),
        batch_size=BATCH,
        world_size=WORLD,
        seed=11,
        epoch_samples=EPOCH_SAMPLES,
    )
    with ControlClient(srv.http_url) as api:
        job = api.create_job(spec)
        assert job.id == post_job(srv, SPEC).json()["id"]  # the same job as the raw spec
        at = next_epoch_step(0, job.status.batches_per_epoch)
        for _rank in range(WORLD):
            status = api.set_mixture(job.id, {"web": 1, "code": 0, "math": 1}, at_step=at)
        assert [c["at_step"] for c in status.schedule] == [0, at]
        assert status.weights_now == list(WEIGHTS) and status.frontier == 0
        now = api.set_mixture(job.id, [1, 1, 1])  # default: the frontier
        assert now.schedule[0] == {"at_step": 0, "weights": [1.0, 1.0, 1.0]}  # replaces step 0
        listed = api.quarantine("math", [1, 2, 2], "duplicate")
        assert listed.total_ids == 2 and listed.entries[-1].at == {job.id: 0}


def test_metrics_show_weights_and_quarantine(srv: ServerProc) -> None:
    """/metrics has each source's share in force for a live mixture job and the number of
    quarantined ids per dataset."""
    job = post_job(srv, SPEC).json()["id"]
    assert put_mixture(srv, job, {"weights": [2, 1, 1]}).status_code == 200
    r = httpx.post(
        f"{srv.http_url}/v1/datasets/web/quarantine",
        json={"ids": [5, 6, 7], "reason": "bad"},
        headers=srv.headers,
        timeout=scaled(10),
    )
    assert r.status_code == 200, r.text
    text = httpx.get(f"{srv.http_url}/metrics", headers=srv.headers, timeout=scaled(10)).text
    assert f'shardserve_mixture_weight{{job_id="{job}",source="web"}} 0.5' in text
    assert f'shardserve_mixture_weight{{job_id="{job}",source="math"}} 0.25' in text
    assert 'shardserve_quarantined_samples{dataset="web"} 3.0' in text
    page = httpx.get(f"{srv.http_url}/", headers=srv.headers, timeout=scaled(10)).text
    assert "mixture at step 0:" in page
    assert all(f"</span> {n} {p}" in page for n, p in (("web", "50%"), ("math", "25%")))
    assert "class='mixchart'" in page  # the schedule drawn


def test_spec_schedule_and_stop_over_http(shared_srv: ServerProc) -> None:
    """A job created with a schedule plans exactly what the planner plans with that schedule
    in positions; a ``stop`` source ends the epoch early, equally on every rank."""
    k = 30
    body = {**SPEC, "schedule": [{"at_step": k, "weights": [0, 1, 1]}]}
    job = post_job(shared_srv, body).json()["id"]
    order = global_order([plan(shared_srv, job, r) for r in range(WORLD)])
    expected = mixture_order(
        [MixSource(n) for n in SIZES.values()],
        11,
        0,
        EPOCH_SAMPLES,
        [Segment(0, WEIGHTS), Segment(k * WORLD * BATCH, (0, 1, 1))],
        world_size=WORLD,
    )
    assert np.array_equal(order, expected)
    src, _ = split_ids(order[k * WORLD * BATCH :], OFFSETS)
    assert not (src == 0).any()  # web has weight 0 from step k on
    stop = {
        **SPEC,
        "mixture": [*SPEC["mixture"][:2], {"name": "math", "weight": 0.2, "on_exhausted": "stop"}],
    }
    job = post_job(shared_srv, stop).json()["id"]
    lengths = []
    for r in range(WORLD):
        resp = httpx.get(
            f"{shared_srv.http_url}/v1/jobs/{job}/plan",
            params={"epoch": 0, "rank": r},
            headers=shared_srv.headers,
            timeout=scaled(60),
        )
        ids = np.frombuffer(resp.content, dtype="<i8")
        lengths.append((len(ids), resp.headers["X-Shardserve-Num-Batches"]))
        math = split_ids(ids, OFFSETS)[1][split_ids(ids, OFFSETS)[0] == 2]
        assert len(set(math.tolist())) == len(math)  # never wrapped
    assert lengths[0] == lengths[1] and lengths[0][0] < EPOCH_SAMPLES // WORLD


def test_journal_replays_changes_and_skips_a_bad_one(tmp_path: Path) -> None:
    """Weight changes and quarantines come back from the journal in order; a change whose
    weights do not fit the job (a hand edit) is skipped, not turned into a failing plan."""
    from shardserve.server.registry.journal import EpochJournal

    spec = JobSpec(
        mixture=(MixtureSource(name="a", weight=1), MixtureSource(name="b", weight=1)),
        batch_size=4,
        world_size=2,
    )
    reg = JobRegistry(EpochJournal(tmp_path / "jobs.jsonl"))
    job, _ = reg.create(spec, 80, (40, 40))
    reg.set_mixture(job.id, WeightChange(at_step=5, weights=(1, 3)), 0)
    reg.add_quarantine("a", [3, 4], "bad", {job.id: 5})
    with open(tmp_path / "jobs.jsonl", "a") as f:
        f.write(f'{{"op":"mixture","id":"{job.id}","at_step":9,"weights":[1,2,3]}}\n')
    again = JobRegistry(EpochJournal(tmp_path / "jobs.jsonl"))
    assert again.load() == 1
    restored = again.get(job.id)
    assert [c.at_step for c in restored.schedule()] == [0, 5]
    assert restored.source_sizes == (40, 40)
    assert [(t, ids.tolist()) for t, ids in again.quarantine.from_step("a", job.id, 40)] == [
        (5, [3, 4])
    ]


def test_an_empty_source_must_weigh_nothing() -> None:
    """A source without samples may be in a mixture only with weight 0, now and in changes."""
    from shardserve.server.jobs.mixtures import check_empty

    spec = JobSpec(
        mixture=(MixtureSource(name="a", weight=1), MixtureSource(name="b", weight=0)),
        batch_size=4,
    )
    check_empty(spec, (10, 0), (1, 0))
    with pytest.raises(BadRequest, match="'b' has no samples"):
        check_empty(spec, (10, 0), (1, 0.5))


def test_a_rank_pinning_another_source_version_is_refused(tmp_path: Path) -> None:
    """Two ranks of one run post the same mixture spec on either side of an ``--overwrite``
    of one source: the second would pin the new version while its peer's live job streams
    the old one, and is refused naming both (the ranks would desynchronise)."""
    for seed, name in enumerate(("p", "q")):
        make_cifar_like(tmp_path / "store", name, n=100, seed=seed)
    spec = {
        "mixture": [{"name": "p", "weight": 1}, {"name": "q", "weight": 1}],
        "batch_size": 10,
        "world_size": 2,
    }
    with run_server(tmp_path / "store", "--state-dir", str(tmp_path / "state")) as s:
        first = post_job(s, spec)
        assert first.status_code == 201, first.text
        with ShardWriter(tmp_path / "store", "q", fields=CIFAR_FIELDS, overwrite=True) as w:
            w.add_batch(
                {"image": np.zeros((100, 3, 32, 32), np.uint8), "label": np.zeros(100, np.int64)}
            )
        again = post_job(s, spec)
        assert again.status_code == 409, again.text
        assert again.json()["code"] == "version_conflict"
        old = first.json()["status"]["spec"]["mixture"][1]["version"]
        assert f"q@{old}" in again.json()["detail"]
