"""Many nodes, no coordinator: two sidecars (two server processes over one store, standing for
two nodes) and four ranks, two per sidecar, each finding its sidecar through SHARDSERVE_URL."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from shardserve.client import Loader
from tests.support.data import make_cifar_like, sample_id_of
from tests.support.resume import assert_resumes_exactly
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

N = 1203  # not a multiple of the world size: the partition pads, every rank still gets as many
WORLD = 4
BATCH = 32


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProc, ServerProc]]:
    root = tmp_path_factory.mktemp("store")
    make_cifar_like(root, n=N, shard_bytes=256 << 10)
    # Each node keeps its own job journal, as on separate machines.
    with (
        run_server(root, "--state-dir", str(root / ".node-a")) as a,
        run_server(root, "--state-dir", str(root / ".node-b")) as b,
    ):
        yield a, b


def sidecar_of(rank: int, nodes: tuple[ServerProc, ServerProc]) -> ServerProc:
    return nodes[rank // 2]  # ranks 0, 1 on node a; 2, 3 on node b


def loader_on(srv: ServerProc, rank: int, monkeypatch: pytest.MonkeyPatch, **kw: object) -> Loader:
    monkeypatch.setenv("SHARDSERVE_URL", srv.http_url)
    return Loader(
        None, "cifar", BATCH, seed=11, rank=rank, world_size=WORLD, timeout=scaled(30), **kw
    )


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_four_ranks_on_two_sidecars_cover_every_sample_once(
    nodes: tuple[ServerProc, ServerProc], monkeypatch: pytest.MonkeyPatch, shuffle: str
) -> None:
    """Across the four ranks every sample arrives exactly once per epoch (plus the padding the
    partition promises), every rank gets the same number of batches, and the job id is the
    same on both sidecars."""
    for epoch in (0, 1):
        seen: list[np.ndarray] = []
        counts = []
        jobs = set()
        for rank in range(WORLD):
            with loader_on(sidecar_of(rank, nodes), rank, monkeypatch, shuffle=shuffle) as ld:
                jobs.add(ld.job_id)
                ld.set_epoch(epoch)
                batches = [sample_id_of({"image": b["image"].numpy()}) for b in ld]
            counts.append(len(batches))
            seen.append(np.concatenate(batches))
        assert len(set(counts)) == 1, f"batch counts differ across ranks: {counts}"
        assert len(jobs) == 1
        ids = np.concatenate(seen)
        per_rank = -(-N // WORLD)
        assert ids.size == per_rank * WORLD
        uniq, times = np.unique(ids, return_counts=True)
        assert np.array_equal(uniq, np.arange(N)), "some sample never arrived"
        assert (times > 1).sum() == per_rank * WORLD - N, "more repeats than the padding"


def test_a_rank_resumes_exactly_on_the_other_sidecar(
    nodes: tuple[ServerProc, ServerProc], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 3 stops mid-epoch on node b; its state loaded on node a continues exactly."""

    def make_iter(state: object) -> tuple[Iterator[object], object]:
        # fresh runs on the rank's own node; the resumed one on the other node
        srv = nodes[1] if state is None else nodes[0]
        ld = loader_on(srv, 3, monkeypatch, shuffle="block")
        ld.set_epoch(2)
        if state is not None:
            ld.load_state_dict(state)  # type: ignore[arg-type]
        return iter(ld), ld.state_dict

    assert_resumes_exactly(
        make_iter,  # type: ignore[arg-type]
        midpoint=4,
        key=lambda b: tuple(sample_id_of({"image": b["image"].numpy()}).tolist()),  # type: ignore[index]
    )
