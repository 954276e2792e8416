"""``shardserve.client.plan``: index-only plans against a real server, equal to what a
``Loader`` with the same arguments streams, deterministic and resumable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import shardserve.client as client
from shardserve.client import BadRequest, Loader, plan
from shardserve.server.planning import epoch_order
from tests.client.conftest import N_CIFAR, ids
from tests.support.resume import assert_resumes_exactly


def _tuple(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in t.tolist())


def test_plan_is_exported() -> None:
    assert "plan" in client.__all__ and client.plan is plan


@pytest.mark.parametrize(
    ("shuffle", "world_size", "drop_last"),
    [
        ("global", 1, False),
        ("block", 2, True),
        ("none", 3, False),
    ],
)
def test_plan_equals_the_streamed_order(
    server, shuffle: str, world_size: int, drop_last: bool
) -> None:
    """Every rank's id batches are the ids of the batches a streaming Loader delivers, in order."""
    for rank in range(world_size):
        kw = dict(seed=7, shuffle=shuffle, rank=rank, world_size=world_size, drop_last=drop_last)
        with (
            plan(server.http_url, "cifar", 48, **kw) as p,
            Loader(server.http_url, "cifar", 48, **kw) as ld,
        ):
            assert p.job_id == ld.job_id and len(p) == len(ld)
            p.set_epoch(2)
            ld.set_epoch(2)
            batches = list(p)
            got = [_tuple(b) for b in batches]
            want = [ids(b) for b in ld]
        assert all(b.dtype == torch.int64 and b.dim() == 1 for b in batches)
        assert got == want and len(got) > 0


def test_plan_is_deterministic_and_moves_on_by_epoch(server) -> None:
    """Two plans of the same job agree; iter() after a full pass plans the next epoch."""
    with (
        plan(server.http_url, "cifar", 100, seed=3, rank=0, world_size=1) as a,
        plan(server.http_url, "cifar", 100, seed=3, rank=0, world_size=1) as b,
    ):
        first = [_tuple(x) for x in a]
        assert first == [_tuple(x) for x in b]
        second = [_tuple(x) for x in a]
        assert second != first
        assert np.concatenate(second).tolist() == epoch_order(N_CIFAR, 3, 1, "global").tolist()
        assert sorted(np.concatenate(first).tolist()) == list(range(N_CIFAR))
        assert a.epoch_ids(1).tolist() == np.concatenate(second).tolist()


def test_plan_resumes_exactly(server) -> None:
    def make_iter(state):
        p = plan(server.http_url, "cifar", 64, seed=1, rank=0, world_size=1)
        if state is not None:
            p.load_state_dict(state)
        else:
            p.set_epoch(5)
        return iter(p), p.state_dict

    assert_resumes_exactly(make_iter, midpoint=6, key=_tuple)


def test_plan_and_loader_states_are_interchangeable(server) -> None:
    """A Loader's state resumes a plan at the next batch, and a plan's state resumes a Loader."""
    kw = dict(seed=9, rank=0, world_size=1)
    with (
        Loader(server.http_url, "cifar", 100, **kw) as ld,
        plan(server.http_url, "cifar", 100, **kw) as p,
    ):
        ld.set_epoch(3)
        it = iter(ld)
        head = [ids(next(it)) for _ in range(4)]
        p.load_state_dict(ld.state_dict())
        tail = [_tuple(b) for b in p]
        assert tail == [ids(b) for b in it]
        assert len(head) + len(tail) == len(ld)
        p.set_epoch(4)
        pit = iter(p)
        for _ in range(2):
            next(pit)
        ld.load_state_dict(p.state_dict())
        assert [ids(b) for b in ld] == [_tuple(b) for b in pit]


def test_plan_envs_follow_their_own_plans(server) -> None:
    """envs=3: a list of 3 id batches a step, env e the order of SeedSequence([seed, epoch, e])."""
    with plan(server.http_url, "cifar", 32, seed=11, envs=3, rank=0, world_size=1) as p:
        p.set_epoch(6)
        steps = list(p)
        assert len(steps) == len(p) and all(len(s) == 3 for s in steps)
        for env in range(3):
            got = torch.cat([s[env] for s in steps]).tolist()
            assert got == epoch_order(N_CIFAR, 11, 6, "global", env=env).tolist()
        assert (
            torch.cat([s[0] for s in steps]).tolist() != torch.cat([s[1] for s in steps]).tolist()
        )


def test_plan_refuses_bad_arguments(server) -> None:
    with pytest.raises(BadRequest, match="envs=0"):
        plan(server.http_url, "cifar", 8, envs=0, rank=0, world_size=1)
    with pytest.raises(BadRequest, match="shuffle='sideways'"):
        plan(server.http_url, "cifar", 8, shuffle="sideways", rank=0, world_size=1)
    with plan(server.http_url, "cifar", 8, rank=0, world_size=1) as p:
        with pytest.raises(BadRequest, match="env 1 out of range"):
            p.epoch_ids(0, env=1)
        with pytest.raises(BadRequest, match="next_batch"):
            p.load_state_dict({**p.state_dict(), "next_batch": 10_000})
        other = plan(server.http_url, "cifar", 16, rank=0, world_size=1)
        with pytest.raises(
            BadRequest, match=r"another job \(batch_size=16 in the state, 8 in this plan"
        ):
            p.load_state_dict(other.state_dict())
        other.close()
