"""Resident mode and per-environment batches against a real server, on the CPU.

The same tests run on a GPU with ``resident="cuda"`` in ``tests/gpu/``; here the data is
resident in host memory, which exercises the same load, plan and gather code.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from shardserve.client import BadRequest, Loader
from shardserve.server.planning import epoch_order, plan
from tests.client.conftest import N_CIFAR, ids
from tests.support.resume import assert_resumes_exactly
from tests.support.slowness import scaled


@pytest.mark.parametrize(("shuffle", "world_size"), [("global", 1), ("block", 2), ("none", 3)])
def test_resident_batches_equal_streamed_batches(server, shuffle: str, world_size: int) -> None:
    """Every rank's resident epoch is byte for byte the streamed epoch, in the same order."""
    for rank in range(world_size):
        kw = dict(seed=5, shuffle=shuffle, rank=rank, world_size=world_size)
        with (
            Loader(server.http_url, "cifar", 48, **kw) as streamed,
            Loader(server.http_url, "cifar", 48, resident="cpu", **kw) as resident,
        ):
            assert resident.stats().transport == "resident"
            assert len(resident) == len(streamed)
            for loader in (streamed, resident):
                loader.set_epoch(3)
            got = list(resident)
            want = list(streamed)
        assert len(got) == len(want) > 0
        for g, w in zip(got, want, strict=True):
            assert g.keys() == w.keys()
            for k in w:
                assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k])


def test_resident_follows_the_plan_and_every_batch_owns_its_storage(server) -> None:
    with Loader(server.http_url, "cifar", 64, seed=2, resident="cpu", rank=0, world_size=1) as ld:
        ld.set_epoch(1)
        batches = list(ld)
    want = plan(N_CIFAR, seed=2, epoch=1, world_size=1, rank=0, batch_size=64)
    assert [ids(b) for b in batches] == [tuple(int(i) for i in b) for b in want]
    storages = [t.untyped_storage().data_ptr() for b in batches for t in b.values()]
    assert len(set(storages)) == len(storages), "two delivered tensors share storage"


def test_resident_resumes_exactly(server) -> None:
    def make_iter(state):
        loader = Loader(server.http_url, "cifar", 100, seed=1, resident="cpu", rank=0, world_size=1)
        if state is not None:
            loader.load_state_dict(state)
        else:
            loader.set_epoch(4)
        return iter(loader), loader.state_dict

    assert_resumes_exactly(make_iter, midpoint=3, key=ids)


def test_resident_and_streaming_states_are_interchangeable(server) -> None:
    """A state saved by a streaming loader resumes in resident mode with exactly the rest."""
    with Loader(server.http_url, "cifar", 100, seed=9, rank=0, world_size=1) as streamed:
        streamed.set_epoch(2)
        it = iter(streamed)
        head = [ids(next(it)) for _ in range(4)]
        state = streamed.state_dict()
        tail = [ids(b) for b in it]
    with Loader(server.http_url, "cifar", 100, seed=9, resident="cpu", rank=0, world_size=1) as r:
        r.load_state_dict(state)
        assert [ids(b) for b in r] == tail
    assert len(head) + len(tail) == len(streamed)


def test_envs_each_follow_their_own_plan_without_aliasing(server) -> None:
    """envs=4: a list of 4 batches a step; env e is the plan of SeedSequence([seed, epoch, e])
    (env 0 the job's own plan), every env batch in storage of its own."""
    n_envs, bs = 4, 32
    with Loader(
        server.http_url, "cifar", bs, seed=11, resident="cpu", envs=n_envs, rank=0, world_size=1
    ) as loader:
        loader.set_epoch(6)
        steps = list(loader)
    assert len(steps) == len(loader) and all(len(s) == n_envs for s in steps)
    for env in range(n_envs):
        order = epoch_order(N_CIFAR, 11, 6, "global", env=env).astype(np.int64)
        got = [i for s in steps for i in ids(s[env])]
        assert got == order.tolist()
    assert steps[0][0]["image"].data_ptr() != steps[0][1]["image"].data_ptr()
    ptrs = [t.untyped_storage().data_ptr() for s in steps[:3] for b in s for t in b.values()]
    assert len(set(ptrs)) == len(ptrs), "env batches share storage"
    # Environment 0 is exactly the single-env loader's batches.
    with Loader(server.http_url, "cifar", bs, seed=11, resident="cpu", rank=0, world_size=1) as one:
        one.set_epoch(6)
        assert [ids(b) for b in one] == [ids(s[0]) for s in steps]


def test_resident_refuses_variable_fields_and_bad_arguments(server) -> None:
    with pytest.raises(BadRequest, match=r"fixed-shape fields.*'x'"):
        Loader(server.http_url, "graphs", 8, resident="cpu", rank=0, world_size=1)
    with pytest.raises(BadRequest, match="resident='gpu'"):
        Loader(server.http_url, "cifar", 8, resident="gpu", rank=0, world_size=1)
    with pytest.raises(BadRequest, match="envs=0"):
        Loader(server.http_url, "cifar", 8, resident="cpu", envs=0, rank=0, world_size=1)
    with pytest.raises(BadRequest, match="is_available"):
        Loader(server.http_url, "cifar", 8, resident="cuda", rank=0, world_size=1)
    # Fields left out make a variable-shape dataset resident-capable.
    with Loader(
        server.http_url, "graphs", 8, resident="cpu", fields=["y"], rank=0, world_size=1
    ) as ld:
        ys = torch.cat([b["y"] for b in ld])
    assert sorted(ys.tolist()) == [float(i) for i in range(120)]


def test_plan_endpoint_matches_the_planner_and_rejects_bad_queries(server) -> None:
    spec = {"dataset": "cifar", "batch_size": 30, "seed": 4, "world_size": 3, "shuffle": "block"}
    r = httpx.post(f"{server.http_url}/v1/jobs", json=spec, timeout=scaled(10))
    job = r.json()["id"]
    got = httpx.get(
        f"{server.http_url}/v1/jobs/{job}/plan", params={"epoch": 2, "rank": 1}, timeout=scaled(10)
    )
    assert got.status_code == 200, got.text
    assert got.headers["content-type"] == "application/octet-stream"
    want = plan(N_CIFAR, 4, 2, 3, 1, 30, "block", shard_rows=_shard_rows(server))
    assert np.frombuffer(got.content, "<i8").tolist() == np.concatenate(list(want)).tolist()
    assert int(got.headers["x-shardserve-num-batches"]) == len(want)
    for params, status in [
        ({"epoch": 0, "rank": 3}, 422),
        ({"epoch": -1}, 422),
        ({"epoch": "x"}, 422),
        ({}, 422),
        ({"epoch": 0, "env": -2}, 422),
    ]:
        bad = httpx.get(f"{server.http_url}/v1/jobs/{job}/plan", params=params, timeout=scaled(10))
        assert bad.status_code == status, (params, bad.text)
        assert "detail" in bad.json()
    missing = httpx.get(
        f"{server.http_url}/v1/jobs/0000000000000000/plan", params={"epoch": 0}, timeout=scaled(10)
    )
    assert missing.status_code == 404


def _shard_rows(server) -> list[int]:
    from shardserve.server.store.catalog import Store

    store = server.proc.args[server.proc.args.index("--store") + 1]
    with Store(store).open("cifar") as ds:
        return list(ds.shard_rows)


def test_resident_refuses_a_field_missing_in_some_samples() -> None:
    """Resident tensors hold no mask: a nullable field would read as made-up zeros."""
    from shardserve.client.resident import field_layout
    from shardserve.proto.api import DatasetInfo

    info = DatasetInfo(
        name="pde",
        num_samples=3,
        num_shards=1,
        bytes=0,
        fields=[
            {"name": "latent", "dtype": "float32", "shape": [4]},
            {"name": "params.nu", "dtype": "float32", "shape": [], "nullable": True},
        ],
    )
    with pytest.raises(BadRequest, match=r"'params\.nu' is missing in some"):
        field_layout(info, None)
    assert list(field_layout(info, ["latent"])) == ["latent"]
