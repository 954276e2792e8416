"""A mixture re-planned after a steering change on a real server: the plan is made on the
planning lane, so a plain job streaming beside it keeps getting batches meanwhile, and the
mixture's batches are exactly the plan its schedule deals."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from shardserve.client import Loader
from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.write.writer import ShardWriter
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

#: Two sources of 500k samples each: an epoch of 32M positions takes seconds to plan.
SOURCE_N, EPOCH = 500_000, 32_000_000
MIX_BATCH, PLAIN_BATCH = 64, 8
AFTER = 20  # mixture batches read past the change
FIELDS = (FieldSpec(name="gid", dtype="int64", shape=()),)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sources ``a`` and ``b`` whose ``gid`` is the id over the mixture's concatenation, and a
    plain dataset ``p``."""
    root = tmp_path_factory.mktemp("replan")
    for k, name in enumerate(("a", "b")):
        with ShardWriter(root, name, fields=FIELDS) as w:
            w.add_batch({"gid": np.arange(SOURCE_N, dtype=np.int64) + k * SOURCE_N})
    with ShardWriter(root, "p", fields=FIELDS) as w:
        w.add_batch({"gid": np.arange(200_000, dtype=np.int64)})
    return root


@pytest.fixture()
def srv(store: Path, tmp_path: Path) -> Iterator[ServerProc]:
    with run_server(store, "--state-dir", str(tmp_path / "state")) as s:
        yield s


def test_plain_job_streams_while_a_mixture_replans(srv: ServerProc) -> None:
    """While a steered mixture's new order is planned, a plain job's batches keep arriving, and
    the mixture's batches before and after the change are the plan of its schedule."""
    events: list[tuple[str, int]] = []
    lock, stop, at_box = threading.Lock(), threading.Event(), [-1]
    mix = Loader(
        srv.http_url,
        {"a": 0.5, "b": 0.5},
        MIX_BATCH,
        seed=5,
        epoch_samples=EPOCH,
        token=srv.token,
        timeout=scaled(120),
    )
    plain = Loader(srv.http_url, "p", PLAIN_BATCH, seed=1, token=srv.token)
    got: list[np.ndarray] = []

    def read_mixture() -> None:
        for i, batch in enumerate(mix):
            got.append(batch["gid"].numpy().copy())
            with lock:
                events.append(("mix", i))
            if at_box[0] >= 0 and i >= at_box[0] + AFTER:
                return

    def read_plain() -> None:
        for i, _ in enumerate(plain):
            with lock:
                events.append(("plain", i))
            if stop.is_set():
                return

    threads = [threading.Thread(target=read_plain), threading.Thread(target=read_mixture)]
    with mix, plain:
        for t in threads:
            t.start()
        while True:  # the mixture streams before it is steered
            with lock:
                if sum(e[0] == "mix" for e in events) >= 10:
                    break
            threads[1].join(scaled(0.05))
        r = httpx.put(  # from the frontier: the next batch the mixture's stream reads
            f"{srv.http_url}/v1/jobs/{mix.job_id}/mixture",
            json={"weights": [0.1, 0.9]},
            headers=srv.headers,
            timeout=scaled(60),
        )
        assert r.status_code == 200, r.text
        at = at_box[0] = r.json()["schedule"][-1]["at_step"]
        threads[1].join(scaled(300))
        stop.set()
        threads[0].join(scaled(60))
        assert not threads[1].is_alive() and not threads[0].is_alive()
        job = mix.job_id
    before = events.index(("mix", at - 1))
    after = events.index(("mix", at))
    plain_meanwhile = sum(e[0] == "plain" for e in events[before:after])
    # A plain client holds a few batches of credit: more than that arrived while the
    # mixture's stream waited for its new order, so the streamer was not held.
    assert plain_meanwhile > 100, (at, plain_meanwhile)
    r = httpx.get(
        f"{srv.http_url}/v1/jobs/{job}/plan",
        params={"epoch": 0, "rank": 0},
        headers=srv.headers,
        timeout=scaled(120),
    )
    assert r.status_code == 200, r.text
    planned = np.frombuffer(r.content, dtype="<i8").reshape(-1, MIX_BATCH)
    assert np.concatenate(got).tobytes() == planned[: len(got)].tobytes()
    assert len(got) > at


def mixture_rank(srv: ServerProc, rank: int) -> Loader:
    """A Loader of rank ``rank`` of 2 of a mixture of ``a`` and ``b`` (its Hello goes out now)."""
    return Loader(
        srv.http_url,
        {"a": 0.5, "b": 0.5},
        MIX_BATCH,
        seed=6,
        epoch_samples=EPOCH,
        rank=rank,
        world_size=2,
        prefetch=2,
        token=srv.token,
        timeout=scaled(60),
    )


@pytest.mark.parametrize("maker", ["rank 1's Hello", "a plan request"])
def test_a_rank_welcomed_while_another_thread_makes_its_new_order_gets_its_batches(
    srv: ServerProc, maker: str
) -> None:
    """A rank whose stream was planned before a steering change, while another thread makes
    the new order (the next Hello's planning, a plan request), gets the plan's batches."""

    def plan(job: str, rank: int) -> bytes:
        r = httpx.get(
            f"{srv.http_url}/v1/jobs/{job}/plan",
            params={"epoch": 0, "rank": rank},
            headers=srv.headers,
            timeout=scaled(300),
        )
        assert r.status_code == 200, r.text
        return r.content

    mix = mixture_rank(srv, 0)
    # Planned after rank 0's Hello (seconds of planning each), so under the change below.
    other = mixture_rank(srv, 1) if maker == "rank 1's Hello" else None
    with mix:
        # Rank 0's order is being made: the change comes before the rank is welcomed.
        r = httpx.put(
            f"{srv.http_url}/v1/jobs/{mix.job_id}/mixture",
            json={"weights": [0.1, 0.9], "at_step": 1},
            headers=srv.headers,
            timeout=scaled(60),
        )
        assert r.status_code == 200, r.text
        request = threading.Thread(target=plan, args=(mix.job_id, 1))
        if other is None:  # the new order, made on the control plane's thread
            request.start()
        got = [b["gid"].numpy().copy() for _, b in zip(range(3), mix, strict=False)]
        if other is None:
            request.join(scaled(300))
            assert not request.is_alive()
        else:
            other.close()
    want = np.frombuffer(plan(mix.job_id, 0), dtype="<i8").reshape(-1, MIX_BATCH)
    assert np.concatenate(got).tobytes() == want[:3].tobytes()
