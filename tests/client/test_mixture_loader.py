"""Mixtures streamed to real Loaders: ``Loader(url, {name: weight})`` over a real server, two
ranks, every sample's bytes checked against the dataset its ``source`` names; a weight change
mid-epoch taking effect exactly at its step on every rank (and a change in the past refused);
``state_dict`` resumes before, at and after the change; the same batches from a second server
and after a kill -9; quarantine from a step; and a source that ends the epoch."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from shardserve.client import Loader, plan
from shardserve.client.control import ControlClient
from shardserve.proto.errors import BadRequest, StepInThePast
from shardserve.proto.jobs import JobSpec, MixtureSource, WeightChange
from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.write.writer import ShardWriter
from tests.support.data import cifar_images, make_cifar_like, sample_id_of
from tests.support.server import ServerProc, free_port, run_server
from tests.support.slowness import scaled

#: Source name -> (samples, the seed its images were drawn with).
SOURCES = {"web": (6000, 0), "code": (4000, 1), "math": (600, 2)}
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}
NEW = {"web": 0.1, "code": 0.1, "math": 0.8}
WORLD, BATCH, EPOCH_SAMPLES = 2, 50, 10_000
STEPS = EPOCH_SAMPLES // WORLD // BATCH  # 100 batches a rank
K = 40  # the step a weight change takes effect at
NAMES = list(SOURCES)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixloader")
    for name, (n, seed) in SOURCES.items():
        make_cifar_like(root, name, n=n, seed=seed, shard_bytes=512 << 10)
    return root


@pytest.fixture()
def srv(store: Path, tmp_path: Path) -> Iterator[ServerProc]:
    with run_server(store, "--state-dir", str(tmp_path / "state")) as s:
        yield s


@pytest.fixture(scope="module")
def shared_srv(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server for the tests whose jobs are their own and left as made: none of them
    changes weights or quarantines (the tests that do get ``srv``)."""
    with run_server(store, "--state-dir", str(tmp_path_factory.mktemp("state"))) as s:
        yield s


def loaders(srv: ServerProc, ranks: range = range(WORLD), **kw: object) -> list[Loader]:
    # prefetch 4: the steps a rank has been granted (and may have read) stay well below K.
    args = {
        "seed": 11,
        "epoch_samples": EPOCH_SAMPLES,
        "world_size": WORLD,
        "timeout": 60.0,
        "prefetch": 4,
    }
    args.update(kw)
    return [
        Loader(srv.http_url, dict(WEIGHTS), BATCH, rank=r, token=srv.token, **args)  # type: ignore[arg-type]
        for r in ranks
    ]


Sample = tuple[int, int]  # (source, id within it)


def samples(batch: dict[str, torch.Tensor], names: list[str] = NAMES) -> list[Sample]:
    """Each sample of ``batch`` as (source, id), its image checked byte for byte against the
    one its source (``names[source]``) holds."""
    src = batch["source"].numpy()
    assert batch["source"].dtype == torch.int16
    ids = sample_id_of({"image": batch["image"].numpy(), "label": batch["label"].numpy()})
    images = batch["image"].numpy()
    for i, (s, j) in enumerate(zip(src.tolist(), ids.tolist(), strict=True)):
        want = cifar_images(j, j + 1, SOURCES[names[s]][1])[0]
        assert np.array_equal(images[i], want), f"sample {i}: not {names[s]}[{j}]"
    return list(zip(src.tolist(), ids.tolist(), strict=True))


def take(
    batches: Iterable[dict[str, torch.Tensor]], n: int | None = None, names: list[str] = NAMES
) -> list[list[Sample]]:
    """The next ``n`` batches of an epoch's iterator, or a Loader's next epoch (``None``:
    all of it)."""
    return [samples(b, names) for b in itertools.islice(batches, n)]


def shares_ok(got: list[Sample], weights: dict[str, float]) -> bool:
    counts = np.bincount([s for s, _ in got], minlength=len(NAMES))
    p = np.array([weights[n] for n in NAMES]) / sum(weights.values())
    n = len(got)
    return bool((np.abs(counts - n * p) <= 5 * np.sqrt(n * p * (1 - p)) + 1).all())


def flat(batches: list[list[Sample]]) -> list[Sample]:
    return [s for b in batches for s in b]


def test_two_ranks_stream_the_mixture_byte_for_byte(srv: ServerProc) -> None:
    """A 3-source mixture over 2 ranks: equal batch counts, every sample the bytes of the
    dataset its ``source`` names, shares within 5 sigma of the weights over 10k samples, a
    source drawn fewer times than it holds disjoint across ranks, and exactly the plan
    ``GET /v1/jobs/{id}/plan`` deals."""
    ranks = loaders(srv)
    try:
        assert len(ranks[0]) == len(ranks[1]) == STEPS
        got = [take(ld) for ld in ranks]
        assert [len(g) for g in got] == [STEPS, STEPS]
        assert shares_ok(flat(got[0]) + flat(got[1]), WEIGHTS)
        web = [{j for s, j in flat(g) if s == 0} for g in got]
        assert sum(s == 0 for s, _ in flat(got[0])) == len(web[0])  # no web sample twice
        assert not web[0] & web[1]
        offsets = np.cumsum([0, *(n for n, _ in SOURCES.values())])
        job = ranks[0].job_id
        with ControlClient(srv.http_url, srv.token) as api:
            for r, g in enumerate(got):
                ids, _ = api.plan(job, 0, r)
                want = [(int(np.searchsorted(offsets, i, "right")) - 1, 0) for i in ids]
                want = [(s, int(i - offsets[s])) for (s, _), i in zip(want, ids, strict=True)]
                assert flat(g) == want
            # plan() with the Loader's arguments deals the same ids (and is the same job).
            with plan(
                srv.http_url,
                dict(WEIGHTS),
                BATCH,
                rank=1,
                world_size=WORLD,
                seed=11,
                epoch_samples=EPOCH_SAMPLES,
                token=srv.token,
            ) as ids_plan:
                assert ids_plan.job_id == job
                first = next(iter(ids_plan)).numpy()
            assert [
                (s, int(i - offsets[s]))
                for s, i in zip(np.searchsorted(offsets, first, "right") - 1, first, strict=True)
            ] == got[1][0]
            # The guide's loop: after an epoch, a change with no step is the next epoch's start
            # (the credit a rank holds at an epoch's end reaches no step of the next).
            assert [c["at_step"] for c in ranks[1].set_mixture(NEW).schedule] == [0, STEPS]
            # What was sent, by source, is what the loop received; and it is what was asked.
            counts = np.bincount([s for g in got for s, _ in flat(g)], minlength=3).tolist()
            status = api.mixture(job)
            assert status.sent == counts and status.window_samples == EPOCH_SAMPLES
            assert status.target_shares == pytest.approx([0.5, 0.3, 0.2])
            assert status.deviation_sigmas is not None and status.deviation_sigmas < 5
        text = httpx.get(f"{srv.http_url}/metrics", headers=srv.headers, timeout=scaled(30)).text
        for name, n in zip(NAMES, counts, strict=True):
            line = f'shardserve_mixture_samples_sent_total{{job_id="{job}",source="{name}"}} {n}.0'
            assert line in text
        assert f'shardserve_mixture_deviation_sigmas{{job_id="{job}"}}' in text
        page = httpx.get(f"{srv.http_url}/", headers=srv.headers, timeout=scaled(30)).text
        assert "class='mixchart'" in page and "largest gap" in page
    finally:
        for ld in ranks:
            ld.close()


def test_a_change_mid_epoch_takes_effect_at_its_step_on_every_rank(
    srv: ServerProc, store: Path, tmp_path: Path
) -> None:
    """Both ranks read 20 batches; a change at step K is set while they stream (one in the
    past is 409); both ranks' batches before K are those of the weights they started with,
    from K on those of a job created with the change in its schedule (on a second server);
    and ``state_dict`` resumes from before K, at K and after K give the same batches."""
    ranks = loaders(srv)
    try:
        its = [iter(ld) for ld in ranks]
        first = [take(it, 20) for it in its]
        api = ranks[0]._job.api
        with pytest.raises(StepInThePast):
            ranks[0].set_mixture(NEW, at_step=5)
        status = ranks[1].set_mixture(NEW, at_step=K)
        ranks[0].set_mixture(NEW, at_step=K)  # every rank sends it: taken once
        assert [c["at_step"] for c in status.schedule] == [0, K]
        assert len(api.mixture(ranks[0].job_id).schedule) == 2
        rest = [take(it) for it in its]
        # Over both ranks' whole epoch: 40 steps of the old weights, 60 of the new.
        asked = api.mixture(ranks[0].job_id).target_shares
        assert asked == pytest.approx([0.4 * WEIGHTS[n] + 0.6 * NEW[n] for n in NAMES])
        states = {}
        for at in (K - 5, K, K + 5):
            ranks[0].load_state_dict(_state(ranks[0], at))
            states[at] = take(ranks[0])
    finally:
        for ld in ranks:
            ld.close()
    streamed = [f + r for f, r in zip(first, rest, strict=True)]
    assert all(len(s) == STEPS for s in streamed)
    for at, got in states.items():
        assert got == streamed[0][at:], f"resume at batch {at}"
    # The same mixture planned with the change from the start, on another server.
    spec = JobSpec(
        mixture=tuple(MixtureSource(name=n, weight=w) for n, w in WEIGHTS.items()),
        batch_size=BATCH,
        world_size=WORLD,
        seed=11,
        epoch_samples=EPOCH_SAMPLES,
        schedule=(WeightChange(at_step=K, weights=tuple(NEW[n] for n in NAMES)),),
    )
    with (
        run_server(store, "--state-dir", str(tmp_path / "other")) as b,
        ControlClient(b.http_url, b.token) as other,
    ):
        job = other.create_job(spec).id
        for r in range(WORLD):
            ids, _ = other.plan(job, 0, r)
            offsets = np.cumsum([0, *(n for n, _ in SOURCES.values())])
            src = np.searchsorted(offsets, ids, "right") - 1
            assert flat(streamed[r]) == list(
                zip(src.tolist(), (ids - offsets[src]).tolist(), strict=True)
            )
    # The change shows: the steps from K on follow the new weights, those before the old.
    after = flat(streamed[0][K:]) + flat(streamed[1][K:])
    assert shares_ok(after, NEW) and not shares_ok(after, WEIGHTS)
    assert shares_ok(flat(streamed[0][:K]) + flat(streamed[1][:K]), WEIGHTS)


def _state(loader: Loader, batch: int) -> dict[str, object]:
    """``loader``'s state as if its loop had received ``batch`` batches of epoch 0."""
    loader.set_epoch(0)
    loader.skip_to(batch)
    return loader.state_dict()


def test_a_state_resumes_on_its_own_and_other_world_sizes(shared_srv: ServerProc) -> None:
    """A mixture's state saved on 2 ranks resumes on 2 ranks (also without its ``versions``
    key, matched by its job id) and on 1, 3 and 4 ranks (mid-epoch, at an epoch's start, or
    every rank's states) at the position it was saved at."""
    ranks = loaders(shared_srv)
    try:
        for ld in ranks:
            take(iter(ld), 3)
        states = [ld.state_dict() for ld in ranks]
        ranks[0].set_epoch(1)
        ranks[0].load_state_dict({k: v for k, v in states[0].items() if k != "versions"})
        assert (ranks[0].state_dict()["epoch"], ranks[0].state_dict()["next_batch"]) == (0, 3)
    finally:
        for ld in ranks:
            ld.close()
    start = {**states[0], "next_batch": 0, "position": 0}
    for world in (1, 3, 4):
        [other] = loaders(shared_srv, range(1), world_size=world)
        with other:
            for state in (states[0], states, start):
                other.load_state_dict(state)  # type: ignore[arg-type]
                assert other.state_dict()["position"] == state_position(state)
            if world == 3:  # it streams from there
                assert len(take(other, 1)) == 1


def state_position(state: object) -> int:
    """The position a state (or the first of a list of states) was saved at."""
    first = state[0] if isinstance(state, list) else state
    assert isinstance(first, dict)
    return int(first["position"])


def test_a_second_server_and_a_kill_9_give_the_same_batches(store: Path, tmp_path: Path) -> None:
    """The mixture with a change set while streaming: rank 1 of a server killed with
    SIGKILL and restarted (the journal replays the change) streams the same batches as rank
    1 of an uninterrupted run on a second server given the same change."""
    http, data = free_port(), free_port()
    state = tmp_path / "state"
    with run_server(store, "--state-dir", str(state), http_port=http, data_port=data) as a:
        (r0, r1) = loaders(a)
        take(iter(r0), 10)
        r0.set_mixture(NEW, at_step=K)
        before = take(iter(r1), 30)
        r0.close()
        a.kill()
        r1.close()
    with run_server(store, "--state-dir", str(state), http_port=http, data_port=data) as a:
        again = loaders(a)
        try:
            replayed = take(again[1])
        finally:
            for ld in again:
                ld.close()
    with run_server(store, "--state-dir", str(tmp_path / "b")) as b:
        ranks = loaders(b)
        try:
            ranks[0].set_mixture(NEW, at_step=K)
            other = take(ranks[1])
        finally:
            for ld in ranks:
                ld.close()
    assert replayed == other
    assert before == other[:30]


def test_two_sidecars_serve_one_mixture_job(srv: ServerProc, store: Path, tmp_path: Path) -> None:
    """Rank 0 from one server, rank 1 from another over the same store: the two ranks
    together are the whole epoch's order as one server deals it, each sample once per
    draw."""
    with run_server(store, "--state-dir", str(tmp_path / "b")) as b:
        (one,) = loaders(srv, range(0, 1))
        (other,) = loaders(b, range(1, 2))
        try:
            got = [take(one), take(other)]
            ids = [one._job.api.plan(one.job_id, 0, r)[0] for r in range(WORLD)]
        finally:
            one.close()
            other.close()
    offsets = np.cumsum([0, *(n for n, _ in SOURCES.values())])
    for r in range(WORLD):
        src = np.searchsorted(offsets, ids[r], "right") - 1
        assert flat(got[r]) == list(
            zip(src.tolist(), (ids[r] - offsets[src]).tolist(), strict=True)
        )
    web = [{j for s, j in flat(g) if s == 0} for g in got]
    assert not web[0] & web[1]


def test_quarantine_from_a_step_and_a_resume_before_it(srv: ServerProc) -> None:
    """Quarantined ids are never read from the step they take effect at; a resume from
    before that step reads them where the plan had them."""
    ranks = loaders(srv)
    try:
        its = [iter(ld) for ld in ranks]
        plain = take(its[0], 10)
        take(its[1], 10)
        rest_before = ranks[0]._job.api.plan(ranks[0].job_id, 0, 0)[0]
        # Every math sample the rest of the epoch would read: quarantine them all but one.
        bad = sorted({int(i) - 10_000 for i in rest_before[10 * BATCH :] if i >= 10_000})[:-1]
        listed = ranks[0]._job.api.quarantine("math", bad, reason="corrupt")
        step = listed.entries[0].at[ranks[0].job_id]
        assert step >= 10
        rest = take(its[0])
        ranks[0].load_state_dict(_state(ranks[0], 5))
        replay = take(ranks[0])
    finally:
        for ld in ranks:
            ld.close()
    streamed = plain + rest
    assert len(streamed) == STEPS
    assert not {j for s, j in flat(streamed[step:]) if s == 2} & set(bad)
    assert replay == streamed[5:]


def test_a_source_that_ends_the_epoch(store: Path, tmp_path: Path) -> None:
    """``on_exhausted="stop"``: the epoch ends when math (600 samples at weight 0.5) runs
    out, on both ranks alike, every math sample read once; a change mid-epoch is refused
    naming the epoch's first step."""
    spec = JobSpec(
        mixture=(
            MixtureSource(name="web", weight=0.5),
            MixtureSource(name="math", weight=0.5, on_exhausted="stop"),
        ),
        batch_size=BATCH,
        world_size=WORLD,
        seed=3,
        epoch_samples=EPOCH_SAMPLES,
    )
    with run_server(store, "--state-dir", str(tmp_path / "state")) as s:
        ranks = [
            Loader(
                s.http_url,
                list(spec.mixture or ()),
                BATCH,
                rank=r,
                world_size=WORLD,
                seed=3,
                epoch_samples=EPOCH_SAMPLES,
                token=s.token,
                timeout=scaled(60.0),
            )
            for r in range(WORLD)
        ]
        # The Loader made the spec written out by hand (the same job).
        assert ranks[0].spec.model_dump() == spec.model_dump()
        try:
            with pytest.raises(BadRequest, match="epoch's first step"):
                ranks[0].set_mixture({"web": 0.9, "math": 0.1}, at_step=7)
            got = [take(ld, names=["web", "math"]) for ld in ranks]
        finally:
            for ld in ranks:
                ld.close()
    assert len(got[0]) == len(got[1]) < STEPS
    math = [j for g in got for s, j in flat(g) if s == 1]
    assert len(math) == len(set(math)) and len(math) > 500


def test_source_is_a_field_served_when_asked_for(shared_srv: ServerProc) -> None:
    """``fields=`` chooses the mixture's ``source`` like any field: left out, the batch has
    none; named, it comes in the same place as with every field."""
    args = {"seed": 11, "epoch_samples": EPOCH_SAMPLES, "token": shared_srv.token}
    with (
        Loader(shared_srv.http_url, dict(WEIGHTS), BATCH, **args) as every,  # type: ignore[arg-type]
        Loader(shared_srv.http_url, dict(WEIGHTS), BATCH, fields=["image"], **args) as bare,  # type: ignore[arg-type]
        Loader(
            shared_srv.http_url,
            dict(WEIGHTS),
            BATCH,
            fields=["source", "label"],
            **args,  # type: ignore[arg-type]
        ) as some,
    ):
        a, b, c = (next(iter(ld)) for ld in (every, bare, some))
    assert set(a) == {"image", "label", "source"} and set(b) == {"image"}
    assert set(c) == {"source", "label"}
    assert torch.equal(a["source"], c["source"]) and torch.equal(a["image"], b["image"])


def test_a_dataset_with_a_field_named_source_streams_as_before(
    shared_srv: ServerProc, store: Path
) -> None:
    """``source`` is a mixture's field only: a plain dataset's own float ``source`` field
    streams untouched (the server counts sources of mixture jobs alone)."""
    values = np.linspace(-1, 1, 64, dtype=np.float32)
    with ShardWriter(store, "floaty", fields=(FieldSpec(name="source", dtype="float32"),)) as w:
        w.add_batch({"source": values})
    with Loader(shared_srv.http_url, "floaty", 16, shuffle=False, token=shared_srv.token) as ld:
        got = torch.cat([b["source"] for b in ld]).numpy()
    assert np.array_equal(got, values)


def test_mixture_arguments_refused_up_front(shared_srv: ServerProc) -> None:
    """What a mixture cannot do is refused before anything streams, naming the argument."""
    with pytest.raises(BadRequest, match="epoch_samples"):
        Loader(shared_srv.http_url, "web", 8, epoch_samples=100, token=shared_srv.token)
    with pytest.raises(BadRequest, match="needs a mixture"):
        Loader(shared_srv.http_url, "web", 8, on_error="quarantine", token=shared_srv.token)
    with (
        Loader(shared_srv.http_url, "web", 8, token=shared_srv.token) as one,
        pytest.raises(BadRequest, match="reads one dataset"),
    ):
        one.set_mixture({"web": 1.0})


def test_a_failing_transform_quarantines_its_sample(store: Path, tmp_path: Path) -> None:
    """``on_error="quarantine"`` on a mixture with a transform chain: in epoch 0 each failing
    sample is served replaced (no batch holds one), and it is quarantined in its dataset from
    the job's next epoch start, which plans none of them; two servers give the same batches
    in both epochs (the step a quarantine takes effect at does not depend on timing)."""
    chain = [{"name": "fail_on", "params": {"every": 97}}]
    args = {
        "seed": 5,
        "epoch_samples": 2000,
        "transforms": chain,
        "on_error": "quarantine",
        "prefetch": 4,
        "timeout": 60.0,
    }
    runs = []
    for name in ("a", "b"):
        with run_server(
            store, "--state-dir", str(tmp_path / name), "--transforms", "tests.transforms.mods"
        ) as s:
            with Loader(s.http_url, dict(WEIGHTS), BATCH, token=s.token, **args) as ld:  # type: ignore[arg-type]
                epochs = [take(ld), take(ld)]  # epochs 0 and 1
                api = ld._job.api
                listed = {n: api.quarantined(n) for n in NAMES}
                planned = api.plan(ld.job_id, 1, 0)[0]
                first_epoch = api.plan(ld.job_id, 0, 0)[0]
                job = ld.job_id
            runs.append(epochs)
    steps = len(runs[0][0])
    assert runs[0] == runs[1] and steps == 2000 // BATCH
    # Failures seen in epoch e are skipped from the first step of epoch e + 1.
    bad: dict[int, set[Sample]] = {steps: set(), 2 * steps: set()}
    for k, n in enumerate(NAMES):
        for e in listed[n].entries:
            assert "fail_on" in e.reason and all(i % 97 == 0 for i in e.ids)
            bad[e.at[job]] |= {(k, i) for i in e.ids}
    assert bad[steps], "no sample failed in epoch 0: the test data changed"
    # A replacement comes from the dataset of the sample it stands in for.
    offsets = np.cumsum([0, *(n for n, _ in SOURCES.values())])
    assert [s for s, _ in flat(runs[0][0])] == (
        np.searchsorted(offsets, first_epoch, "right") - 1
    ).tolist()
    served = [s for epoch in runs[0] for s in flat(epoch)]
    assert not {s for s in served if s[1] % 97 == 0}  # each one replaced, in both epochs
    src = np.searchsorted(offsets, planned, "right") - 1
    assert not set(zip(src.tolist(), (planned - offsets[src]).tolist(), strict=True)) & bad[steps]
