"""Mixtures combined with the other job options, each against its plain form's contract: a
shared mixture's subscribers get the unshared Loader's bytes, assembled once; environments
(independent and split) follow their plans byte for byte, steer at their step and resume. Real
server, real Loaders (threads of this process)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from shardserve.client import Loader
from tests.support.data import (
    cifar_images,
    graph_sample,
    make_cifar_like,
    make_graph_like,
    sample_id_of,
)
from tests.support.resume import assert_resumes_exactly
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

#: Source name -> (samples, the seed its images were drawn with).
SOURCES = {"web": (900, 0), "code": (600, 1), "math": (200, 2)}
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}
BATCH, EPOCH_SAMPLES = 32, 1280  # 40 batches on one rank
WAIT_S = 90.0
NAMES = list(SOURCES)
OFFSETS = np.cumsum([0, *(n for n, _ in SOURCES.values())])

Record = tuple[tuple[str, str, tuple[int, ...], str], ...]


def record(batch: dict[str, torch.Tensor]) -> Record:
    """A batch as compared: each field's dtype, shape and the sha256 of its bytes."""
    return tuple(
        (
            k,
            str(t.dtype),
            tuple(t.shape),
            hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest(),
        )
        for k, t in sorted(batch.items())
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixcombos")
    for name, (n, seed) in SOURCES.items():
        make_cifar_like(root, name, n=n, seed=seed, shard_bytes=128 << 10)
    return root


@pytest.fixture(scope="module")
def srv(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    with run_server(store, "--state-dir", str(tmp_path_factory.mktemp("state"))) as s:
        yield s


def mix_loader(srv: ServerProc, **kw: Any) -> Loader:
    args: dict[str, Any] = {
        "seed": 5,
        "epoch_samples": EPOCH_SAMPLES,
        "prefetch": 8,
        "timeout": scaled(45.0),
        "token": srv.token,
    } | kw
    return Loader(srv.http_url, dict(WEIGHTS), BATCH, **args)


def counter(srv: ServerProc, name: str) -> float:
    r = httpx.get(f"{srv.http_url}/metrics", headers=srv.headers, timeout=scaled(30))
    assert r.status_code == 200, r.text
    for line in r.text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_shared_mixture_subscribers_get_unshared_bytes_assembled_once(srv: ServerProc) -> None:
    """Three subscribers of a shared mixture pass, held together after two batches, each get
    the unshared mixture Loader's epoch byte for byte; the server assembles it once."""
    with mix_loader(srv) as alone:
        alone.set_epoch(0)
        want = [record(b) for b in alone]
    assert len(want) == EPOCH_SAMPLES // BATCH
    assembled = "shardserve_batches_assembled_total"
    before = counter(srv, assembled)
    gate, results = threading.Event(), [[] for _ in range(3)]  # type: list[list[Record]]
    reached = [threading.Event() for _ in range(3)]
    errors: list[BaseException] = []
    jobs: set[str] = set()

    def run(i: int) -> None:
        try:
            with mix_loader(srv, share="mixshare") as ld:
                jobs.add(ld.job_id)
                ld.set_epoch(0)
                for b in ld:
                    results[i].append(record(b))
                    if len(results[i]) == 2:
                        reached[i].set()
                        assert gate.wait(scaled(WAIT_S)), "the gate stayed shut"
        except BaseException as e:  # handed to the test's thread below
            errors.append(e)
        finally:
            reached[i].set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for ev in reached:
        assert ev.wait(scaled(WAIT_S)), "a subscriber did not reach batch 2"
    gate.set()
    for t in threads:
        t.join(scaled(WAIT_S))
        assert not t.is_alive(), "a subscriber did not finish its epoch"
    assert not errors, errors
    assert len(jobs) == 1
    for got in results:
        assert got == want
    assert counter(srv, assembled) - before == len(want)


Sample = tuple[int, int]  # (source, id within it)


def samples(batch: dict[str, torch.Tensor]) -> tuple[Sample, ...]:
    """Each sample of ``batch`` as (source, id), its image checked byte for byte against the
    one its source holds."""
    src = batch["source"].numpy()
    ids = sample_id_of({"image": batch["image"].numpy(), "label": batch["label"].numpy()})
    for i, (s, j) in enumerate(zip(src.tolist(), ids.tolist(), strict=True)):
        want = cifar_images(j, j + 1, SOURCES[NAMES[s]][1])[0]
        assert np.array_equal(batch["image"].numpy()[i], want), f"sample {i}: not {NAMES[s]}[{j}]"
    return tuple(zip(src.tolist(), ids.tolist(), strict=True))


def as_samples(ids: np.ndarray) -> list[Sample]:
    """Ids over the sources concatenated (a mixture plan's) as (source, id within it)."""
    src = np.searchsorted(OFFSETS, ids, "right") - 1
    return [(int(s), int(i - OFFSETS[s])) for s, i in zip(src, ids, strict=True)]


def steps(ld: Loader, epoch: int) -> list[tuple[tuple[Sample, ...], ...]]:
    """An epoch's steps, each as its environments' samples (one environment: its batch)."""
    ld.set_epoch(epoch)
    return [(samples(s),) if isinstance(s, dict) else tuple(map(samples, s)) for s in ld]


def plan_of(srv: ServerProc, job: str, epoch: int, rank: int, env: int | None) -> list[Sample]:
    params = {"epoch": epoch, "rank": rank} | ({} if env is None else {"env": env})
    r = httpx.get(
        f"{srv.http_url}/v1/jobs/{job}/plan", params=params, headers=srv.headers, timeout=scaled(30)
    )
    assert r.status_code == 200, r.text
    return as_samples(np.frombuffer(r.content, "<i8"))


def test_independent_envs_follow_their_own_mixture_plans(srv: ServerProc) -> None:
    """envs=2: env 0 is the one-environment mixture Loader byte for byte, env 1
    another mixture order; each env's samples are ``GET .../plan?env=e``'s, whole steps the
    plan without ``env``; two Loaders agree step for step."""
    with mix_loader(srv, envs=2, seed=21) as ld:
        got = steps(ld, 1)
        job = str(ld.job_id)
    with mix_loader(srv, envs=2, seed=21) as again:
        assert got == steps(again, 1)
    assert len(got) == EPOCH_SAMPLES // BATCH
    with mix_loader(srv, seed=21) as one:
        single = [s for step in steps(one, 1) for b in step for s in b]
    per_env = [[s for step in got for s in step[e]] for e in range(2)]
    assert per_env[0] == single
    assert per_env[1] != per_env[0] and len(per_env[1]) == EPOCH_SAMPLES
    for e in range(2):
        assert plan_of(srv, job, 1, 0, e) == per_env[e]
    assert plan_of(srv, job, 1, 0, None) == [s for step in got for b in step for s in b]


def test_split_envs_deal_one_mixture_shuffle(srv: ServerProc) -> None:
    """env_shuffle="split" on 2 ranks: env e of rank r is the mixture order dealt as rank
    2r+e of 4, so an epoch serves every position of the one order once."""
    with mix_loader(srv, seed=22) as one:
        order = [s for step in steps(one, 0) for b in step for s in b]
    seen: list[Sample] = []
    for rank in range(2):
        kw = {"envs": 2, "env_shuffle": "split", "rank": rank, "world_size": 2, "seed": 22}
        with mix_loader(srv, **kw) as ld:
            got = steps(ld, 0)
        assert len(got) == EPOCH_SAMPLES // (4 * BATCH)
        for e in range(2):
            assert [s for step in got for s in step[e]] == order[rank * 2 + e :: 4]
        seen += [s for step in got for b in step for s in b]
    assert sorted(seen) == sorted(order)


@pytest.mark.parametrize("env_shuffle", ["independent", "split"])
def test_envs_steer_at_their_step_and_resume(srv: ServerProc, env_shuffle: str) -> None:
    """A change to math only at step 8: every environment's batches before it mix the
    sources, from it on are math only; a state taken at step 5 resumes exactly."""
    kw = {"envs": 2, "env_shuffle": env_shuffle, "seed": 23 + (env_shuffle == "split")}
    with mix_loader(srv, **kw) as ld:
        ld.set_mixture({"web": 0.0, "code": 0.0, "math": 1.0}, at_step=8)
        got = steps(ld, 0)
    before = {s for step in got[:8] for b in step for s, _ in b}
    assert before == {0, 1, 2}, before
    assert all(s == 2 for step in got[8:] for b in step for s, _ in b)

    def make_iter(state: dict[str, Any] | None) -> tuple[Any, Any]:
        loader = mix_loader(srv, **kw)
        if state is None:
            loader.set_epoch(0)
        else:
            loader.load_state_dict(state)
        return iter(loader), loader.state_dict

    assert_resumes_exactly(make_iter, midpoint=5, key=lambda step: tuple(samples(b) for b in step))


GRAPHS = {"ga": (150, 0), "gb": (90, 3)}


def test_a_mixture_of_graph_datasets_collates_each_batch_as_its_graphs(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """collate="graph" over two graph datasets: each batch holds its graphs (named by
    ``source`` and ``y``) concatenated and offset as a one-dataset graph batch is, in the
    order ``GET .../plan`` deals, and a second Loader gets the same bytes."""
    root = tmp_path_factory.mktemp("mixgraphs")
    for name, (n, seed) in GRAPHS.items():
        make_graph_like(root, name, n=n, seed=seed)
    offsets = np.cumsum([0, *(n for n, _ in GRAPHS.values())])
    seeds = [seed for _, seed in GRAPHS.values()]
    kw: dict[str, Any] = {
        "seed": 4,
        "collate": "graph",
        "fields": ["x", "edge_index", "y", "source"],
        "epoch_samples": 160,
        "timeout": scaled(45.0),
    }
    with run_server(root, "--state-dir", str(root / "state")) as gsrv:
        weights = {"ga": 0.6, "gb": 0.4}
        with Loader(gsrv.http_url, weights, 16, token=gsrv.token, **kw) as ld:
            ld.set_epoch(0)
            got = [{k: v.clone() for k, v in b.items()} for b in ld]
            job = str(ld.job_id)
        with Loader(gsrv.http_url, weights, 16, token=gsrv.token, **kw) as again:
            again.set_epoch(0)
            assert [[record({k: v}) for k, v in sorted(b.items())] for b in again] == [
                [record({k: v}) for k, v in sorted(b.items())] for b in got
            ]
        r = httpx.get(
            f"{gsrv.http_url}/v1/jobs/{job}/plan",
            params={"epoch": 0, "rank": 0},
            headers=gsrv.headers,
            timeout=scaled(30),
        )
        assert r.status_code == 200, r.text
        plan = np.frombuffer(r.content, "<i8").reshape(-1, 16)
    assert len(got) == len(plan) == 10
    for b, ids in zip(got, plan, strict=True):
        src = np.searchsorted(offsets, ids, "right") - 1
        local = ids - offsets[src]
        assert b["source"].tolist() == src.tolist()
        assert b["y"].tolist() == local.astype(np.float32).tolist()
        graphs = [graph_sample(int(i), seeds[s]) for s, i in zip(src, local, strict=True)]
        xs = [np.asarray(g["x"]) for g in graphs]
        assert np.array_equal(b["x"].numpy(), np.concatenate(xs))
        starts = np.cumsum([0, *(len(x) for x in xs)])[:-1]
        edges = [np.asarray(g["edge_index"]) + o for g, o in zip(graphs, starts, strict=True)]
        assert np.array_equal(b["edge_index"].numpy(), np.concatenate(edges, axis=1))
        assert b["batch"].tolist() == [k for k, x in enumerate(xs) for _ in range(len(x))]
