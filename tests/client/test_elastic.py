"""Elastic resume with real servers: a state saved on 4 ranks after k batches resumes on 2, 3, 4
or 6 ranks, every sample of the epoch exactly once (plus the documented padding), ranks
disjoint, equal batches per rank; also over a server killed with SIGKILL in between."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from shardserve.client import Loader
from shardserve.client.plan import plan as index_plan
from shardserve.server.planning import plan
from tests.client.conftest import N_CIFAR, ids
from tests.support.server import ServerProc, free_port, run_server
from tests.support.slowness import scaled

BATCH = 10
SAVED_ON = 4
K = 2  # batches every rank of the 4 received before the save: position 4 * 10 * 2 = 80
EPOCH = 1


def _loaders(url: str, world: int, shuffle: str, drop_last: bool) -> list[Loader]:
    return [
        Loader(
            url,
            "cifar",
            BATCH,
            seed=5,
            shuffle=shuffle,
            drop_last=drop_last,
            rank=r,
            world_size=world,
            timeout=scaled(60),
        )
        for r in range(world)
    ]


def _save(url: str, shuffle: str, drop_last: bool) -> tuple[list[dict[str, Any]], list[int]]:
    """Every rank of 4 takes K batches of EPOCH; their states and the ids they received."""
    states, before = [], []
    for ld in _loaders(url, SAVED_ON, shuffle, drop_last):
        with ld:
            ld.set_epoch(EPOCH)
            for b in itertools.islice(iter(ld), K):
                before.extend(ids(b))
            states.append(ld.state_dict())
    return states, before


def _resume(
    url: str, world: int, shuffle: str, drop_last: bool, state: object
) -> tuple[list[list[tuple[int, ...]]], list[str]]:
    """Each rank of ``world`` loads ``state`` and takes the rest of the epoch: its batches."""
    per_rank, job_ids = [], []
    for ld in _loaders(url, world, shuffle, drop_last):
        with ld:
            ld.load_state_dict(state)  # type: ignore[arg-type]
            per_rank.append([ids(b) for b in ld])
            job_ids.append(ld.job_id)
            assert ld.state_dict()["epoch"] == EPOCH + 1  # the epoch ended; the next is whole
    return per_rank, job_ids


def _check(
    before: list[int], per_rank: list[list[tuple[int, ...]]], world: int, drop_last: bool
) -> None:
    lengths = {len(r) for r in per_rank}
    assert len(lengths) == 1, f"unequal batches per rank: {lengths}"
    after = [i for r in per_rank for b in r for i in b]
    rest = N_CIFAR - SAVED_ON * BATCH * K
    counts = Counter(before + after)
    if drop_last:  # the tail the M ranks cannot share in whole batches is dropped
        assert max(counts.values()) == 1
        kept = rest // world // BATCH * BATCH * world
        assert len(after) == kept and rest - kept < world * BATCH
    else:  # every sample, plus fewer than `world` padding ids (each a rank's last)
        assert set(counts) == set(range(N_CIFAR))
        pads = -(-rest // world) * world - rest
        assert sum(counts.values()) == N_CIFAR + pads and pads < world
        heads = [i for r in per_rank for i in [j for b in r for j in b][:-1]]
        assert len(set(heads)) == len(heads), "ranks overlap"


@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
@pytest.mark.parametrize("world", [2, 3, 4, 6])
def test_state_of_4_ranks_resumes_on_2_3_4_6(server: ServerProc, shuffle: str, world: int) -> None:
    states, before = _save(server.http_url, shuffle, False)
    assert {s["position"] for s in states} == {SAVED_ON * BATCH * K}
    assert len(set(before)) == len(before) == SAVED_ON * BATCH * K
    per_rank, job_ids = _resume(server.http_url, world, shuffle, False, states[0])
    _check(before, per_rank, world, False)
    # Exactly the pure planner's deal of the rest of the epoch's order over `world` ranks
    # (block: compared through the invariants above, its shard layout is the store's).
    if shuffle != "block":
        for r, got in enumerate(per_rank):
            want = plan(N_CIFAR, 5, EPOCH, world, r, BATCH, shuffle, position=80)  # type: ignore[arg-type]
            assert got == [tuple(int(i) for i in b) for b in want]
    status = httpx.get(f"{server.http_url}/v1/jobs/{job_ids[0]}", timeout=scaled(10)).json()
    saved_by = states[0]["job"]
    assert status["resumed_from"] == (None if world == SAVED_ON else saved_by)
    if world != SAVED_ON:  # the link is on the status page too
        page = httpx.get(f"{server.http_url}/", timeout=scaled(10)).text
        assert f"resumed from job <a href='#job-{saved_by}'>" in page


@pytest.mark.parametrize("world", [3, 6])
def test_drop_last_resume_drops_only_the_tail(server: ServerProc, world: int) -> None:
    states, before = _save(server.http_url, "global", True)
    per_rank, _ = _resume(server.http_url, world, "global", True, states[0])
    _check(before, per_rank, world, True)


def test_every_ranks_states_are_accepted_and_checked(server: ServerProc) -> None:
    """A list of all 4 ranks' states resumes like one; states of different steps are refused."""
    states, before = _save(server.http_url, "global", False)
    per_rank, _ = _resume(server.http_url, 3, "global", False, states)
    _check(before, per_rank, 3, False)
    behind = {**states[2], "next_batch": 1, "position": BATCH * SAVED_ON}
    with (
        Loader(server.http_url, "cifar", BATCH, seed=5, rank=0, world_size=3) as ld,
        pytest.raises(ValueError, match=r"disagree on 'position'.*rank 2 has 40"),
    ):
        ld.load_state_dict([*states[:2], behind, states[3]])


def test_same_world_resume_is_the_uninterrupted_epoch(server: ServerProc) -> None:
    """At the world size it was saved on, a resume yields exactly the rest of the plan."""
    states, _ = _save(server.http_url, "global", False)
    per_rank, _ = _resume(server.http_url, SAVED_ON, "global", False, states[1])
    for r, got in enumerate(per_rank):
        want = list(plan(N_CIFAR, 5, EPOCH, SAVED_ON, r, BATCH, "global"))[K:]
        assert got == [tuple(int(i) for i in b) for b in want]


def test_index_plan_and_resident_resume_elastically(server: ServerProc) -> None:
    """plan() and resident mode take the same state and deal the same rest."""
    states, before = _save(server.http_url, "global", False)
    with index_plan(server.http_url, "cifar", BATCH, seed=5, rank=1, world_size=3) as p:
        p.load_state_dict(states[0])
        got = [tuple(int(i) for i in b) for b in p]
    want = plan(N_CIFAR, 5, EPOCH, 3, 1, BATCH, "global", position=80)
    assert got == [tuple(int(i) for i in b) for b in want]
    per_rank = []
    for r in range(3):
        with Loader(
            server.http_url, "cifar", BATCH, seed=5, rank=r, world_size=3, resident="cpu"
        ) as ld:
            ld.load_state_dict(states[3])
            per_rank.append([ids(b) for b in ld])
    _check(before, per_rank, 3, False)


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_resume_across_a_server_killed_with_sigkill(store: Path, shuffle: str) -> None:
    """Saved on 4 ranks of one server, which is then killed -9; a new server resumes on 3."""
    with run_server(store) as first:
        states, before = _save(first.http_url, shuffle, False)
        first.kill()
    with run_server(store) as second:
        per_rank, _ = _resume(second.http_url, 3, shuffle, False, states[0])
    _check(before, per_rank, 3, False)


def test_env_steps_resume_on_another_world_size(server: ServerProc) -> None:
    """envs=2: a step holds one batch of each environment; one position resumes both orders,
    each environment's samples exactly once over the save on 4 ranks and the resume on 3."""

    def loaders(world: int) -> list[Loader]:
        return [
            Loader(server.http_url, "cifar", BATCH, seed=5, envs=2, rank=r, world_size=world)
            for r in range(world)
        ]

    before: list[list[int]] = [[], []]
    states = []
    for ld in loaders(SAVED_ON):
        with ld:
            ld.set_epoch(EPOCH)
            for step in itertools.islice(iter(ld), K):
                for e, b in enumerate(step):
                    before[e].extend(ids(b))
            states.append(ld.state_dict())
    assert states[0]["position"] == SAVED_ON * BATCH * K
    per_env: list[list[list[tuple[int, ...]]]] = [[], []]
    for ld in loaders(3):
        with ld:
            ld.load_state_dict(states[0])
            steps = list(ld)
            for e in range(2):
                per_env[e].append([ids(s[e]) for s in steps])
    for e in range(2):
        _check(before[e], per_env[e], 3, False)
    assert before[0] != before[1]  # two orders, not one twice


def test_resumed_epoch_survives_a_kill9_while_streaming(store: Path, tmp_path: Path) -> None:
    """A server killed with SIGKILL in the middle of the resumed epoch (restarted on the same
    ports): each rank's stream re-opens at its next batch of the same deal, the job link is
    stated again, and the epoch is still every sample exactly once."""
    http, data = free_port(), free_port()
    args = ("--state-dir", str(tmp_path / "state"))
    with run_server(store, *args, http_port=http, data_port=data, workdir=tmp_path / "w") as srv:
        states, before = _save(srv.http_url, "global", False)
        resumed = _loaders(srv.http_url, 3, "global", False)
        for ld in resumed:
            ld.load_state_dict(states[0])
        first = iter(resumed[0])  # one pass across the crash: a new iter() is the next epoch
        per_rank = [[ids(b) for b in itertools.islice(first, 5)]]
        srv.kill()
    with run_server(store, *args, http_port=http, data_port=data, workdir=tmp_path / "w") as srv:
        per_rank[0] += [ids(b) for b in first]
        per_rank += [[ids(b) for b in ld] for ld in resumed[1:]]
        status = httpx.get(f"{srv.http_url}/v1/jobs/{resumed[0].job_id}", timeout=scaled(10)).json()
        for ld in resumed:
            ld.close()
    _check(before, per_rank, 3, False)
    for r, got in enumerate(per_rank):
        want = plan(N_CIFAR, 5, EPOCH, 3, r, BATCH, "global", position=80)
        assert got == [tuple(int(i) for i in b) for b in want]
    assert status["resumed_from"] == states[0]["job"]


def test_split_env_steps_resume_on_another_world_size(server: ServerProc) -> None:
    """env_shuffle="split": a state of 4 ranks of 2 envs resumes on 3 ranks, every sample of
    the one order exactly once (plus padding), as a deal over 4*2 then 3*2 plans."""

    def loaders(world: int) -> list[Loader]:
        return [
            Loader(
                server.http_url,
                "cifar",
                BATCH,
                seed=5,
                envs=2,
                env_shuffle="split",
                rank=r,
                world_size=world,
            )
            for r in range(world)
        ]

    before: list[int] = []
    states = []
    for ld in loaders(SAVED_ON):
        with ld:
            ld.set_epoch(EPOCH)
            for step in itertools.islice(iter(ld), 1):
                before += [i for b in step for i in ids(b)]
            states.append(ld.state_dict())
    assert {s["position"] for s in states} == {SAVED_ON * 2 * BATCH}
    after: list[list[tuple[int, ...]]] = []
    for ld in loaders(3):
        with ld:
            ld.load_state_dict(states[0])
            steps = list(ld)
            after += [[ids(s[e]) for s in steps] for e in range(2)]
    counts = Counter(before + [i for env in after for b in env for i in b])
    rest = N_CIFAR - len(before)
    pads = -(-rest // 6) * 6 - rest
    assert set(counts) == set(range(N_CIFAR)) and sum(counts.values()) == N_CIFAR + pads
