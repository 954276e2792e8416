"""Datasets have versions: ``ingest --overwrite`` while jobs stream never mixes two
versions into one epoch, never leaves a stale job, and a restart after it fails the old job with
``DatasetChanged`` naming both ids. Real servers, real ``shardserve ingest`` subprocesses."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest

from shardserve.client import Loader, ResumeRefused
from shardserve.client.plan import plan as index_plan
from shardserve.proto.errors import DatasetChanged
from shardserve.server.store.catalog import Store
from shardserve.server.store.versions import content_id
from tests.support.data import cifar_images, make_cifar_like, sample_id_of
from tests.support.server import ServerProc, free_port, run_server
from tests.support.slowness import scaled

N = 600
BATCH = 50


def _ingest_overwrite(store: Path, tmp: Path, n: int, seed: int) -> str:
    """``shardserve ingest --overwrite`` of a cifar-like ``cifar`` with ``n`` samples whose
    payload comes from ``seed``; returns the new version's content id."""
    src = tmp / f"cifar-{n}-{seed}.npz"
    labels = np.arange(n, dtype=np.int64) % 10
    np.savez(src, image=cifar_images(0, n, seed), label=labels)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardserve.server",
            "ingest",
            str(src),
            "--store",
            str(store),
            "--name",
            "cifar",
            "--overwrite",
            "--quiet",
            "--shard-size",
            "256KiB",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert r.returncode == 0, r.stderr
    version = Store(store).version("cifar")
    r = subprocess.run(
        [sys.executable, "-m", "shardserve.server", "inspect", "--store", str(store), "cifar"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert f"version   {version}" in r.stdout, r.stdout + r.stderr
    return version


def _check(batch: dict, images: np.ndarray) -> list[int]:
    """Sample ids of ``batch``; every image must be byte-equal to ``images[id]`` (one version)."""
    got = batch["image"].numpy()
    ids = sample_id_of({"image": got, "label": batch["label"].numpy()})
    bad = [int(i) for j, i in enumerate(ids) if not np.array_equal(got[j], images[i])]
    assert not bad, f"samples {bad[:5]} come from another version of the dataset"
    return ids.tolist()


def _job(srv: ServerProc, jid: str) -> dict:
    r = httpx.get(f"{srv.http_url}/v1/jobs/{jid}", timeout=scaled(10))
    assert r.status_code == 200, r.text
    return r.json()


class _Server:
    """A server on pinned ports and state dir, restartable after kill -9."""

    def __init__(self, store: Path, tmp: Path) -> None:
        self.store, self.tmp = store, tmp
        self.http, self.data = free_port(), free_port()
        self.stack = contextlib.ExitStack()
        self.srv: ServerProc | None = None

    def start(self) -> ServerProc:
        self.srv = self.stack.enter_context(
            run_server(
                self.store,
                "--state-dir",
                str(self.tmp / "state"),
                http_port=self.http,
                data_port=self.data,
                workdir=self.tmp / "work",
            )
        )
        return self.srv

    def kill(self) -> None:
        assert self.srv is not None
        self.srv.kill()

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    make_cifar_like(root, "cifar", n=N, seed=0, shard_bytes=256 << 10)
    return root


def test_overwrite_same_count_while_streaming_never_mixes(store: Path, tmp_path: Path) -> None:
    """Overwrite (same count) while rank 0 streams: rank 0 and rank 1 (which opens its stream
    after) both get the old version's bytes for the whole epoch; a Loader created after gets the
    new version under another job id."""
    old_images = cifar_images(0, N, 0)
    old_version = Store(store).version("cifar")
    with _Server(store, tmp_path) as s:
        srv = s.start()
        loaders = [
            Loader(
                srv.http_url,
                "cifar",
                batch_size=BATCH,
                seed=3,
                rank=k,
                world_size=2,
                prefetch=2,
                timeout=scaled(20.0),
            )
            for k in range(2)
        ]
        try:
            assert loaders[0].job_id == loaders[1].job_id
            its = [iter(ld) for ld in loaders]
            seen: list[list[int]] = [[], []]
            for _ in range(2):
                seen[0] += _check(next(its[0]), old_images)
            new_version = _ingest_overwrite(store, tmp_path, N, seed=1)
            assert new_version != old_version
            for batch in its[1]:  # rank 1 opens its stream only now
                seen[1] += _check(batch, old_images)
            for batch in its[0]:
                seen[0] += _check(batch, old_images)
            assert sorted(seen[0] + seen[1]) == list(range(N))
            assert _job(srv, loaders[0].job_id)["spec"]["version"] == old_version
            # A Loader created after the overwrite: a job of its own, on the new bytes.
            with Loader(
                srv.http_url, "cifar", batch_size=BATCH, seed=3, timeout=scaled(20.0)
            ) as fresh:
                assert fresh.job_id != loaders[0].job_id
                got = [i for b in fresh for i in _check(b, cifar_images(0, N, 1))]
            assert sorted(got) == list(range(N))
            # The old job goes on with its version in the next epoch too.
            loaders[0].set_epoch(1)
            assert len([_check(b, old_images) for b in loaders[0]]) == len(loaders[0])
        finally:
            for ld in loaders:
                ld.close()


def test_overwrite_with_another_count_gets_a_new_job(store: Path, tmp_path: Path) -> None:
    """Overwrite 600 -> 1000 samples: a new Loader gets a 1000-sample job (no stale 600-sample
    job, no "shard_rows sum to 1000 but n_samples is 600"), also after a kill -9 restart,
    while the old Loader finishes its epoch on its 600; after the restart the old job is
    failed with DatasetChanged naming both versions."""
    old_images = cifar_images(0, N, 0)
    old_version = Store(store).version("cifar")
    with _Server(store, tmp_path) as s:
        srv = s.start()
        with Loader(srv.http_url, "cifar", batch_size=BATCH, seed=5, timeout=scaled(20.0)) as old:
            it = iter(old)
            head = _check(next(it), old_images)
            new_version = _ingest_overwrite(store, tmp_path, 1000, seed=2)
            new_images = cifar_images(0, 1000, 2)
            with Loader(
                srv.http_url, "cifar", batch_size=BATCH, seed=5, timeout=scaled(20.0)
            ) as new:
                assert new.job_id != old.job_id and len(new) == 1000 // BATCH
                got = [i for b in new for i in _check(b, new_images)]
                assert sorted(got) == list(range(1000))
            rest = [i for b in it for i in _check(b, old_images)]
            assert sorted(head + rest) == list(range(N))
            old_id = old.job_id
        s.kill()
        srv = s.start()
        st = _job(srv, old_id)
        assert st["state"] == "failed", st
        assert old_version in st["error"] and new_version in st["error"], st["error"]
        with Loader(srv.http_url, "cifar", batch_size=BATCH, seed=5, timeout=scaled(20.0)) as new:
            got = [i for b in new for i in _check(b, new_images)]
            assert sorted(got) == list(range(1000))
            assert _job(srv, new.job_id)["num_samples"] == 1000


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "no-journal"])
def test_restart_after_overwrite_mid_epoch_raises_dataset_changed(
    store: Path, tmp_path: Path, journal: bool
) -> None:
    """kill -9 mid-epoch, overwrite (same count), restart: the Loader raises DatasetChanged
    instead of finishing the epoch from the new data, with or without the job journal."""
    old_images = cifar_images(0, N, 0)
    with _Server(store, tmp_path) as s:
        srv = s.start()
        with Loader(
            srv.http_url, "cifar", batch_size=BATCH, seed=7, prefetch=1, timeout=scaled(15.0)
        ) as ld:
            seen: list[int] = []
            it = iter(ld)
            for _ in range(3):
                seen += _check(next(it), old_images)
            s.kill()
            _ingest_overwrite(store, tmp_path, N, seed=1)
            if not journal:
                (tmp_path / "state" / "jobs.jsonl").unlink()
            s.start()
            with pytest.raises(DatasetChanged) as info:
                for batch in it:
                    seen += _check(batch, old_images)
            assert Counter(seen).most_common(1)[0][1] == 1  # nothing twice on the way
            assert content_id(Store(store).manifest("cifar")) in str(info.value)


def test_job_pins_version_and_store_refuses_a_gone_one(store: Path, tmp_path: Path) -> None:
    """The job's spec names its version; a spec naming another version is a 409
    ``dataset_changed`` that names both ids."""
    version = Store(store).version("cifar")
    with run_server(store, "--state-dir", str(tmp_path / "state")) as srv:
        r = httpx.post(
            f"{srv.http_url}/v1/jobs",
            json={"dataset": "cifar", "batch_size": 10},
            timeout=scaled(10),
        )
        assert r.status_code in (200, 201) and r.json()["status"]["spec"]["version"] == version
        r = httpx.post(
            f"{srv.http_url}/v1/jobs",
            json={"dataset": "cifar", "batch_size": 10, "version": "0123456789abcdef"},
            timeout=scaled(10),
        )
        assert r.status_code == 409 and r.json()["code"] == "dataset_changed"
        assert "0123456789abcdef" in r.json()["detail"] and version in r.json()["detail"]


def test_a_rank_created_after_overwrite_is_refused_naming_both_versions(
    store: Path, tmp_path: Path
) -> None:
    """Without a process group: rank 0's Loader pins the old version, ``ingest --overwrite``
    runs, rank 1's Loader (same spec) would pin the new one and is refused with
    VersionConflict (a DatasetChanged) naming both versions, while rank 0 streams on; once the
    old run is deleted, a new run's ranks all get the new version."""
    from shardserve.proto.errors import VersionConflict

    old_images = cifar_images(0, N, 0)
    old_version = Store(store).version("cifar")
    kw = {"batch_size": BATCH, "seed": 4, "world_size": 2, "prefetch": 2, "timeout": 20.0}
    with _Server(store, tmp_path) as s:
        srv = s.start()
        with Loader(srv.http_url, "cifar", rank=0, **kw) as rank0:  # type: ignore[arg-type]
            it = iter(rank0)
            seen = _check(next(it), old_images)
            new_version = _ingest_overwrite(store, tmp_path, N + 100, seed=1)
            with pytest.raises(VersionConflict) as e:
                Loader(srv.http_url, "cifar", rank=1, **kw)  # type: ignore[arg-type]
            assert isinstance(e.value, DatasetChanged)
            assert old_version in str(e.value) and new_version in str(e.value), str(e.value)
            assert rank0.job_id in str(e.value)
            seen += [i for b in it for i in _check(b, old_images)]
            assert len(seen) == N // 2 and len(set(seen)) == N // 2
            old_id = rank0.job_id
        r = httpx.delete(f"{srv.http_url}/v1/jobs/{old_id}", timeout=scaled(10))
        assert r.status_code == 200, r.text
        new_images = cifar_images(0, N + 100, 1)
        ranks = [Loader(srv.http_url, "cifar", rank=k, **kw) for k in range(2)]  # type: ignore[arg-type]
        try:
            assert ranks[0].job_id == ranks[1].job_id != old_id
            got = [i for ld in ranks for b in ld for i in _check(b, new_images)]
            assert sorted(got) == list(range(N + 100))
        finally:
            for ld in ranks:
                ld.close()


def test_a_state_without_versions_resumes_on_its_version_only(store: Path, tmp_path: Path) -> None:
    """A state without its ``versions`` key is matched by its job id: it resumes on its own version
    (on another world size too) and is refused mid-epoch on another unless allowed."""
    # Such a state was saved before states recorded versions, or edited. After ``ingest
    # --overwrite`` a Loader (and a plan) of the new version refuses it mid-epoch with
    # ResumeRefused, before any batch, naming the two ways on, instead of 100 old samples then the
    # new version's rest; at an epoch's start it loads; ``allow_other_version=True`` resumes it
    # knowingly. A version 1 state (no job id) cannot be matched: refused mid-epoch even on its own
    # version.
    old_images = cifar_images(0, N, 0)
    kw = {"batch_size": BATCH, "seed": 3, "timeout": 20.0}
    with run_server(store, "--state-dir", str(tmp_path / "state")) as srv:
        url = srv.http_url
        pair = [Loader(url, "cifar", rank=r, world_size=2, prefetch=2, **kw) for r in range(2)]  # type: ignore[arg-type]
        one = Loader(url, "cifar", **kw)  # type: ignore[arg-type]
        try:
            seen = [i for ld in pair for i in _check(next(iter(ld)), old_images)]
            st = pair[0].state_dict()
            assert st["position"] == 2 * BATCH and st["versions"]
            with_versions = dict(st)
            del st["versions"]
            v1 = {k: st[k] for k in ("spec", "epoch", "next_batch", "rank", "world_size")}
            with pytest.raises(ResumeRefused, match="names neither the dataset version nor"):
                one.load_state_dict({**v1, "version": 1})
            new_version = _ingest_overwrite(store, tmp_path, 1000, seed=1)
            # Its own version, 2 ranks' state on 1 rank: the rest of that epoch, old bytes.
            one.load_state_dict(st)
            rest = [i for b in one for i in _check(b, old_images)]
            assert sorted(seen + rest) == list(range(N))
        finally:
            for ld in (*pair, one):
                ld.close()
        new_images = cifar_images(0, 1000, 1)
        with Loader(url, "cifar", **kw) as new:  # type: ignore[arg-type]
            assert new.job_id != st["job"]
            with pytest.raises(ResumeRefused) as e:
                new.load_state_dict(st)
            said = str(e.value)
            for part in (st["job"], new_version, "set_epoch(0)", "allow_other_version=True"):
                assert part in said, said
            assert new.state_dict()["position"] == 0  # nothing was restored
            with pytest.raises(ResumeRefused, match=with_versions["versions"]):
                new.load_state_dict(with_versions)
            for start in (st, with_versions):  # an epoch's start: nothing of it to mix
                new.load_state_dict({**start, "next_batch": 0, "position": 0})
            new.load_state_dict(st, allow_other_version=True)
            got = [i for b in new for i in _check(b, new_images)]
            assert len(got) == 1000 - 2 * BATCH
        with index_plan(url, "cifar", BATCH, seed=3, timeout=20.0) as ids:
            with pytest.raises(ResumeRefused, match=st["job"]):
                ids.load_state_dict(st)
            ids.load_state_dict(st, allow_other_version=True)
            assert len(list(ids)) == (1000 - 2 * BATCH) // BATCH
