"""``Loader(envs=n)`` while streaming, against a real server: one batch per step carries every
environment's batch; each environment follows its own plan, owns its storage, and resumes."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from shardserve.client import BadRequest, Loader, plan
from shardserve.server.planning import epoch_order
from tests.client.conftest import N_CIFAR, ids
from tests.support.resume import assert_resumes_exactly
from tests.support.slowness import scaled

ENVS, BS = 4, 32


def _step_ids(step: list[dict[str, torch.Tensor]]) -> tuple[tuple[int, ...], ...]:
    return tuple(ids(b) for b in step)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_each_env_follows_its_own_plan_in_storage_of_its_own(server, transport: str) -> None:
    """env e's batches are the order of SeedSequence([seed, epoch, e]) cut in 32s (env 0 the
    single-env Loader's), and no two tensors of a step share storage or memory."""
    with Loader(
        server.http_url, "cifar", BS, seed=11, envs=ENVS, rank=0, world_size=1, transport=transport
    ) as ld:
        ld.set_epoch(6)
        steps = list(ld)
        assert len(steps) == len(ld) == -(-N_CIFAR // BS)
    assert all(isinstance(s, list) and len(s) == ENVS for s in steps)
    for env in range(ENVS):
        got = [i for s in steps for i in ids(s[env])]
        assert got == epoch_order(N_CIFAR, 11, 6, "global", env=env).tolist()
    for s in steps:
        storages = [t.untyped_storage().data_ptr() for b in s for t in b.values()]
        assert len(set(storages)) == len(storages), "env batches (or fields) share storage"
        tensors = [t for b in s for t in b.values()]
        for i, a in enumerate(tensors):
            for b in tensors[i + 1 :]:
                assert not np.shares_memory(a.numpy(), b.numpy())
    with Loader(server.http_url, "cifar", BS, seed=11, rank=0, world_size=1) as one:
        one.set_epoch(6)
        assert [ids(b) for b in one] == [ids(s[0]) for s in steps]


def test_env_batches_outlive_later_steps(server) -> None:
    """Batches kept across many steps (more than the ring has slots) keep their bytes."""
    with Loader(
        server.http_url, "cifar", BS, seed=2, envs=3, rank=0, world_size=1, prefetch=2
    ) as ld:
        ld.set_epoch(0)
        kept = [(s, _step_ids(s)) for s in ld]
    assert [_step_ids(s) for s, _ in kept] == [k for _, k in kept]


def test_one_env_label_saves_alone(server) -> None:
    """torch.save of one env's 32 labels writes about 32 int64s, not the step or the slot."""
    with Loader(server.http_url, "cifar", BS, seed=0, envs=ENVS, rank=0, world_size=1) as ld:
        step = next(iter(ld))
    buf = io.BytesIO()
    torch.save(step[2]["label"], buf)
    assert buf.tell() < 32 * 8 + 2048, f"{buf.tell()} bytes saved for a 32-label tensor"


def test_streaming_envs_is_deterministic_and_equals_the_plan_api(server) -> None:
    """Two Loaders agree step for step; plan(envs=4) gives the same ids in the same order."""
    kw = dict(seed=5, rank=0, world_size=1)
    with (
        Loader(server.http_url, "cifar", BS, envs=ENVS, **kw) as a,
        Loader(server.http_url, "cifar", BS, envs=ENVS, **kw) as b,
        plan(server.http_url, "cifar", BS, envs=ENVS, **kw) as p,
    ):
        for x in (a, b, p):
            x.set_epoch(2)
        got = [_step_ids(s) for s in a]
        assert got == [_step_ids(s) for s in b]
        assert p.job_id == a.job_id, "plan(envs=n) and Loader(envs=n) are one job"
        assert got == [tuple(tuple(i.tolist()) for i in s) for s in p]
        assert p.epoch_ids(2, env=3).tolist() == [i for s in got for i in s[3]]
        # A Loader's state resumes the plan at the same step, and back.
        b.set_epoch(3)
        it = iter(b)
        next(it), next(it)
        p.load_state_dict(b.state_dict())
        assert [tuple(tuple(i.tolist()) for i in s) for s in p] == [_step_ids(s) for s in it]


def test_streaming_envs_resumes_exactly(server) -> None:
    def make_iter(state):
        ld = Loader(server.http_url, "cifar", BS, seed=1, envs=3, rank=0, world_size=1)
        if state is not None:
            ld.load_state_dict(state)
        else:
            ld.set_epoch(4)
        return iter(ld), ld.state_dict

    assert_resumes_exactly(make_iter, midpoint=7, key=_step_ids)


def test_streaming_envs_across_ranks_and_devices(server) -> None:
    """Two ranks split each env's order; devices=[...] places env e on devices[e % len]."""
    seen: dict[int, list[int]] = {e: [] for e in range(2)}
    for rank in range(2):
        with Loader(
            server.http_url,
            "cifar",
            25,
            seed=3,
            envs=2,
            rank=rank,
            world_size=2,
            devices=["cpu"],
            drop_last=True,
        ) as ld:
            ld.set_epoch(1)
            for s in ld:
                assert all(b["image"].device.type == "cpu" and len(b["label"]) == 25 for b in s)
                for e in range(2):
                    seen[e] += ids(s[e])
    for e in range(2):
        order = epoch_order(N_CIFAR, 3, 1, "global", env=e).tolist()
        assert sorted(seen[e]) == sorted(order), f"env {e}: the ranks do not cover its order once"


def test_streaming_envs_refuses_what_it_cannot_cut(server) -> None:
    with pytest.raises(BadRequest, match=r"fixed-shape fields.*'x'"):
        Loader(server.http_url, "graphs", 8, envs=2, rank=0, world_size=1)
    with pytest.raises(BadRequest, match="envs=0"):
        Loader(server.http_url, "cifar", 8, envs=0, rank=0, world_size=1)
    with Loader(server.http_url, "graphs", 8, envs=2, fields=["y"], rank=0, world_size=1) as ld:
        ys = [y for s in ld for b in s for y in b["y"].tolist()]
    assert sorted(ys[: len(ys) // 2]) != [] and len(ys) == 2 * 8 * -(-120 // 8)


def test_plan_endpoint_env_k_is_env_k_of_the_stream(server) -> None:
    """``GET /v1/jobs/{id}/plan?env=K`` of an envs job: env K's own ids and batches (equal to
    ``plan().epoch_ids(K)`` and to env K of every streamed step), different for each K; without
    ``env`` the whole steps as streamed; an env past the job's environments is a 422."""
    import httpx

    kw = dict(seed=7, rank=1, world_size=2)
    with (
        Loader(server.http_url, "cifar", BS, envs=ENVS, **kw) as ld,
        plan(server.http_url, "cifar", BS, envs=ENVS, **kw) as p,
    ):
        ld.set_epoch(3)
        steps = [_step_ids(s) for s in ld]
        url = f"{server.http_url}/v1/jobs/{ld.job_id}/plan"
        per_env = []
        for env in range(ENVS):
            r = httpx.get(url, params={"epoch": 3, "rank": 1, "env": env}, timeout=scaled(10))
            assert r.status_code == 200, r.text
            got = np.frombuffer(r.content, "<i8").tolist()
            assert got == [i for s in steps for i in s[env]], f"env {env}"
            assert got == p.epoch_ids(3, env=env).tolist()
            assert int(r.headers["x-shardserve-num-batches"]) == len(steps)
            per_env.append(got)
        assert len({tuple(e) for e in per_env}) == ENVS, "every env got the same ids"
        whole = httpx.get(url, params={"epoch": 3, "rank": 1}, timeout=scaled(10))
        assert np.frombuffer(whole.content, "<i8").tolist() == [
            i for s in steps for e in s for i in e
        ]
        bad = httpx.get(url, params={"epoch": 3, "rank": 1, "env": ENVS}, timeout=scaled(10))
        assert bad.status_code == 422 and f"0 <= env < {ENVS}" in bad.json()["detail"]


def test_split_envs_deal_one_shuffle(server) -> None:
    """env_shuffle="split": the job's own order dealt across the envs (env e of rank r as rank
    r*n+e of world*n), so a step's envs never share a sample, an epoch covers each sample once
    in len/(n*b) steps, and env 0 is not the single-env Loader's plan."""
    order = epoch_order(N_CIFAR, 11, 6, "global").tolist()
    seen: list[int] = []
    for rank in range(2):
        with Loader(
            server.http_url,
            "cifar",
            BS,
            seed=11,
            envs=2,
            env_shuffle="split",
            rank=rank,
            world_size=2,
        ) as ld:
            ld.set_epoch(6)
            steps = list(ld)
        assert len(steps) == len(ld) == -(-N_CIFAR // 4 // BS)
        for e in range(2):
            got = [i for s in steps for i in ids(s[e])]
            assert got == order[rank * 2 + e :: 4], f"rank {rank} env {e}"
        for s in steps:
            flat = [i for b in s for i in ids(b)]
            assert len(set(flat)) == len(flat), "two envs of a step share a sample"
        seen += [i for s in steps for b in s for i in ids(b)]
    assert sorted(seen) == list(range(N_CIFAR)), "the epoch is not every sample once"
    with Loader(
        server.http_url,
        "cifar",
        BS,
        seed=11,
        envs=4,
        env_shuffle="split",
        drop_last=True,
        rank=0,
        world_size=1,
    ) as ld:
        assert len(ld) == N_CIFAR // 4 // BS == len(list(ld))


def test_split_envs_agree_with_plan_resident_and_the_plan_endpoint(server) -> None:
    """plan(), a resident Loader and GET .../plan?env=K give the stream's split steps; a
    state passes between the stream and plan() and resumes exactly."""
    import httpx

    kw = dict(seed=9, rank=0, world_size=1, envs=3, env_shuffle="split")
    with (
        Loader(server.http_url, "cifar", BS, **kw) as ld,
        Loader(server.http_url, "cifar", BS, resident="cpu", **kw) as res,
        plan(server.http_url, "cifar", BS, **kw) as p,
    ):
        for x in (ld, res, p):
            x.set_epoch(2)
        got = [_step_ids(s) for s in ld]
        assert got == [_step_ids(s) for s in res]
        assert got == [tuple(tuple(i.tolist()) for i in s) for s in p]
        assert p.job_id == ld.job_id
        url = f"{server.http_url}/v1/jobs/{ld.job_id}/plan"
        for env in range(3):
            r = httpx.get(url, params={"epoch": 2, "rank": 0, "env": env}, timeout=scaled(10))
            assert np.frombuffer(r.content, "<i8").tolist() == [i for s in got for i in s[env]]
        ld.set_epoch(3)
        it = iter(ld)
        next(it), next(it)
        p.load_state_dict(ld.state_dict())
        assert [tuple(tuple(i.tolist()) for i in s) for s in p] == [_step_ids(s) for s in it]

    def make_iter(state):
        loader = Loader(server.http_url, "cifar", BS, **kw)
        if state is not None:
            loader.load_state_dict(state)
        else:
            loader.set_epoch(4)
        return iter(loader), loader.state_dict

    assert_resumes_exactly(make_iter, midpoint=3, key=_step_ids)


def test_split_envs_refuse_one_env_and_unknown_modes(server) -> None:
    with pytest.raises(BadRequest, match=r"env_shuffle='split'.*envs > 1"):
        Loader(server.http_url, "cifar", BS, env_shuffle="split", rank=0, world_size=1)
    with pytest.raises(BadRequest, match="env_shuffle"):
        Loader(
            server.http_url,
            "cifar",
            BS,
            envs=2,
            rank=0,
            world_size=1,
            env_shuffle="each",  # type: ignore[arg-type]
        )
