"""Mixtures combined with ``resident`` and with an elastic resume, each against its plain
form's contract: resident batches are the streamed ones byte for byte and follow the pure
planner; a weight change or a quarantine taken on 2 ranks holds at its place in the order
when the state resumes on 3. Real server, real Loaders (threads of this process)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from shardserve.client import Loader
from shardserve.proto.errors import StepInThePast
from shardserve.proto.jobs import MixtureSource
from shardserve.server.planning import RankPlan
from shardserve.server.planning.mixture import MixSource, Quarantine, Segment, mixture_order
from tests.client.test_mixture_combos import SOURCES, WEIGHTS, Sample, as_samples, samples
from tests.support.data import make_cifar_like
from tests.support.resume import assert_resumes_exactly
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

BATCH, EPOCH_SAMPLES = 32, 1280
MIX = [MixSource(n) for n, _ in SOURCES.values()]
W0 = tuple(WEIGHTS.values())


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root: Path = tmp_path_factory.mktemp("mixres")
    for name, (n, seed) in SOURCES.items():
        make_cifar_like(root, name, n=n, seed=seed, shard_bytes=128 << 10)
    return root


@pytest.fixture(scope="module")
def srv(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    with run_server(store, "--state-dir", str(tmp_path_factory.mktemp("state"))) as s:
        yield s


def mix_loader(srv: ServerProc, **kw: Any) -> Loader:
    args: dict[str, Any] = {
        "epoch_samples": EPOCH_SAMPLES,
        "prefetch": 2,
        "timeout": scaled(45.0),
        "token": srv.token,
    } | kw
    dataset = args.pop("dataset", dict(WEIGHTS))
    return Loader(srv.http_url, dataset, BATCH, **args)


def reference(
    seed: int,
    epoch: int,
    segs: list[Segment],
    world: int,
    rank: int,
    offset: int = 0,
    quarantine: tuple[Quarantine, ...] = (),
) -> tuple[list[tuple[Sample, ...]], list[Sample]]:
    """The pure planner's batches of ``rank`` of ``world`` as (source, id) samples, and the
    epoch's whole order."""
    order = mixture_order(MIX, seed, epoch, EPOCH_SAMPLES, segs, world, quarantine)
    plan = RankPlan.from_order(order, world, rank, BATCH, False, offset)
    return [tuple(as_samples(np.asarray(b))) for b in plan], as_samples(order)


def test_resident_mixture_is_the_streamed_mixture_byte_for_byte(srv: ServerProc) -> None:
    """On each of 2 ranks a resident mixture epoch equals the streamed one tensor for tensor
    (``source`` too), and both are the pure planner's order over the sources' bytes."""
    for rank in range(2):
        kw = {"seed": 31, "rank": rank, "world_size": 2}
        with mix_loader(srv, **kw) as streamed, mix_loader(srv, resident="cpu", **kw) as res:
            assert res.stats().transport == "resident"
            assert len(res) == len(streamed)
            streamed.set_epoch(2)
            res.set_epoch(2)
            got, want = list(res), list(streamed)
        assert len(got) == len(want) > 0
        for g, w in zip(got, want, strict=True):
            assert g.keys() == w.keys() and "source" in g
            for k in w:
                assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]), k
        ref, _ = reference(31, 2, [Segment(0, W0)], 2, rank)
        assert [samples(b) for b in got] == ref


def test_resident_mixture_whose_stop_source_ends_the_epoch(srv: ServerProc) -> None:
    """With math ``on_exhausted="stop"`` the resident epoch ends where the streamed one does,
    batch for batch the same bytes."""
    stop = [
        MixtureSource(name=name, weight=w, on_exhausted="stop" if name == "math" else "repeat")
        for name, w in WEIGHTS.items()
    ]
    kw: dict[str, Any] = {"seed": 37, "rank": 1, "world_size": 2}
    got, want = [], []
    for resident, out in ((None, want), ("cpu", got)):
        with mix_loader(srv, resident=resident, dataset=stop, **kw) as ld:
            ld.set_epoch(0)
            out += [samples(b) for b in ld]
    assert got == want and 0 < len(want) < EPOCH_SAMPLES // (2 * BATCH)


def test_resident_mixture_resumes_exactly(srv: ServerProc) -> None:
    """A resident mixture's state taken after 5 batches resumes with exactly the rest."""

    def make_iter(state: dict[str, Any] | None) -> tuple[Any, Any]:
        loader = mix_loader(srv, seed=32, resident="cpu")
        if state is None:
            loader.set_epoch(1)
        else:
            loader.load_state_dict(state)
        return iter(loader), loader.state_dict

    assert_resumes_exactly(make_iter, midpoint=5, key=samples)


def test_resident_mixture_steers_from_the_next_epoch(srv: ServerProc) -> None:
    """A resident mixture gathers from a plan of the whole epoch: a change inside it is
    refused (409), the default one takes the next epoch, which then reads math only."""
    with mix_loader(srv, seed=33, resident="cpu") as ld:
        ld.set_epoch(0)
        it = iter(ld)
        first = [samples(next(it)) for _ in range(2)]
        with pytest.raises(StepInThePast):
            ld.set_mixture({"web": 0.0, "code": 0.0, "math": 1.0}, at_step=len(ld) - 1)
        ld.set_mixture({"web": 0.0, "code": 0.0, "math": 1.0})
        rest = [samples(b) for b in it]
        assert first + rest == reference(33, 0, [Segment(0, W0)], 1, 0)[0]
        nxt = [samples(b) for b in ld]
    assert len(nxt) == len(ld) and all(s == 2 for b in nxt for s, _ in b)


def test_a_change_taken_on_2_ranks_holds_at_its_place_resumed_on_3(srv: ServerProc) -> None:
    """Math only from step 7 of 2 ranks (position 448, inside step 4 of 3 ranks), a state
    after 3 batches (position 192) resumed on 3 ranks, web only from their step 9: each rank
    of 3 gets the pure planner's deal of the rest, bytes checked, and every position of the
    epoch is served once (plus the padding of the last round)."""
    math_only, web_only = (0.0, 0.0, 1.0), (1.0, 0.0, 0.0)
    saving = [mix_loader(srv, seed=34, rank=r, world_size=2) for r in range(2)]
    before: list[Sample] = []
    try:
        saving[0].set_mixture(dict(zip(WEIGHTS, math_only, strict=True)), at_step=7)
        for ld in saving:
            ld.set_epoch(0)
            before += [s for b in itertools.islice(iter(ld), 3) for s in samples(b)]
        state = saving[0].state_dict()
    finally:
        for ld in saving:
            ld.close()
    assert state["position"] == 192
    resumed = [mix_loader(srv, seed=34, rank=r, world_size=3) for r in range(3)]
    try:
        for ld in resumed:
            ld.load_state_dict(state)
        resumed[0].set_mixture(dict(zip(WEIGHTS, web_only, strict=True)), at_step=9)
        got = [[samples(b) for b in ld] for ld in resumed]
    finally:
        for ld in resumed:
            ld.close()
    segs = [Segment(0, W0), Segment(7 * 2 * BATCH, math_only), Segment(9 * 3 * BATCH, web_only)]
    for rank in range(3):
        want, order = reference(34, 0, segs, 3, rank, offset=192)
        assert got[rank] == want, f"rank {rank} of 3"
    saved_on_2 = [s for r in range(2) for b in reference(34, 0, segs, 2, r)[0][:3] for s in b]
    assert Counter(before) == Counter(saved_on_2) == Counter(order[:192])
    after = [s for rank in got for b in rank for s in b]
    pads = -(-(EPOCH_SAMPLES - 192) // 3) * 3 - (EPOCH_SAMPLES - 192)
    assert Counter(after) == Counter(order[192:] + order[:pads])
    assert {s for s, _ in order[448:864]} == {2} and {s for s, _ in order[864:]} == {0}


def test_a_resident_mixture_resumes_a_steered_state_on_another_world_size(
    srv: ServerProc,
) -> None:
    """A state of 2 ranks with math only from step 5 (position 320), resumed resident on 3
    ranks: each gets the pure planner's deal of the rest with the change at its place."""
    math_only = (0.0, 0.0, 1.0)
    saving = [mix_loader(srv, seed=35, rank=r, world_size=2) for r in range(2)]
    try:
        saving[0].set_mixture(dict(zip(WEIGHTS, math_only, strict=True)), at_step=5)
        for ld in saving:
            ld.set_epoch(0)
            list(itertools.islice(iter(ld), 2))
        state = saving[0].state_dict()
    finally:
        for ld in saving:
            ld.close()
    segs = [Segment(0, W0), Segment(5 * 2 * BATCH, math_only)]
    for rank in range(3):
        with mix_loader(srv, seed=35, rank=rank, world_size=3, resident="cpu") as ld:
            ld.load_state_dict(state)
            got = [samples(b) for b in ld]
        assert got == reference(35, 0, segs, 3, rank, offset=state["position"])[0], rank


def test_a_quarantine_taken_on_2_ranks_holds_at_its_place_resumed_on_3(
    store: Path, tmp_path: Path
) -> None:
    """Math ids quarantined at the frontier of 2 ranks (step f, position f * 64), a state
    after 3 batches resumed on 3 ranks: the ids are served before position f * 64 only, each
    rank the pure planner's deal of the rest with that quarantine."""
    bad = list(range(0, 200, 4))
    with run_server(store, "--state-dir", str(tmp_path / "state")) as own:
        saving = [mix_loader(own, seed=36, rank=r, world_size=2) for r in range(2)]
        try:
            for ld in saving:
                ld.set_epoch(0)
                list(itertools.islice(iter(ld), 3))
            url = f"{own.http_url}/v1/datasets/math/quarantine"
            body = {"ids": bad, "reason": "corrupt"}
            r = httpx.post(url, json=body, headers=own.headers, timeout=scaled(30))
            assert r.status_code == 200, r.text
            [entry] = r.json()["entries"]
            step = entry["at"][saving[0].job_id]
            state = saving[0].state_dict()
        finally:
            for ld in saving:
                ld.close()
        assert 3 <= step < EPOCH_SAMPLES // (2 * BATCH)
        got = []
        for rank in range(3):
            with mix_loader(own, seed=36, rank=rank, world_size=3) as ld:
                ld.load_state_dict(state)
                got.append([samples(b) for b in ld])
    quarantine = (Quarantine(2, step * 2 * BATCH, np.asarray(bad, dtype=np.int64)),)
    segs = [Segment(0, W0)]
    for rank in range(3):
        want, order = reference(36, 0, segs, 3, rank, 192, quarantine)
        assert got[rank] == want, f"rank {rank} of 3"
    late = {i for s, i in order[step * 2 * BATCH :] if s == 2}
    assert late and not late & set(bad)
