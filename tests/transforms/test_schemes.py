"""Randomness schemes through a real server: a job from before schemes were recorded keeps
its augmentation across a restart and a state_dict resume (or is refused mid-epoch), and
under the current scheme a sample is augmented the same in any batch, rank, world size,
pool and resume."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from shardserve.client import Loader
from shardserve.client.state import ResumeRefused
from shardserve.proto.jobs import JobSpec, job_id
from tests.support.server import ServerProc, free_port, job_status, make_job, run_server
from tests.support.slowness import scaled
from tests.transforms.conftest import CIFAR_CHAIN, MODS, digest

BATCH = 50


def _pre_scheme_job(srv: ServerProc) -> str:
    """The job an older server made for a Loader of CIFAR_CHAIN: pinned to the dataset's
    version, no ``transform_rng`` (what such a server journaled)."""
    version = job_status(srv, make_job(srv, batch_size=7))["spec"]["version"]
    spec = JobSpec(
        dataset="cifar", batch_size=BATCH, seed=3, transforms=CIFAR_CHAIN, version=version
    )
    body = {k: v for k, v in spec.model_dump(mode="json").items() if v is not None}
    jid = make_job(srv, **body)
    assert jid == job_id(spec) and job_status(srv, jid)["spec"].get("transform_rng") is None
    return jid


def _loader(url: str, **kw: Any) -> Loader:
    return Loader(
        url, "cifar", batch_size=BATCH, seed=3, transforms=CIFAR_CHAIN, timeout=scaled(30), **kw
    )


def _epoch(url: str, epoch: int = 1) -> tuple[str, list[str]]:
    with _loader(url) as ld:
        ld.set_epoch(epoch)
        return ld.job_id, [digest(b) for b in ld]


@pytest.mark.slow
def test_pre_scheme_job_keeps_its_augmentation_across_a_restart(
    store: Path, tmp_path: Path
) -> None:
    """A journaled job without a scheme is found by a Loader of its spec, serves scheme 1's
    bytes (not a new job's), and serves them again after a kill -9 and restart."""
    http, data = free_port(), free_port()
    args = ("--state-dir", str(tmp_path / "state"))
    with run_server(store) as fresh:
        new_id, new = _epoch(fresh.http_url)
        assert job_status(fresh, new_id)["spec"]["transform_rng"] == 2
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(
            run_server(store, *args, http_port=http, data_port=data, workdir=tmp_path / "w")
        )
        old_id = _pre_scheme_job(srv)
        got_id, ref = _epoch(srv.http_url)
        assert got_id == old_id and ref != new
        got: list[str] = []
        with _loader(srv.http_url, prefetch=2, transport="ipc") as ld:
            ld.set_epoch(1)
            for i, batch in enumerate(ld):
                got.append(digest(batch))
                if i == 4:
                    srv.kill()
                    srv = stack.enter_context(
                        run_server(
                            store, *args, http_port=http, data_port=data, workdir=tmp_path / "w"
                        )
                    )
            assert ld.stats().reconnects >= 1 and ld.job_id == old_id
        assert got == ref


@pytest.mark.slow
def test_pre_scheme_state_resumes_identically_or_is_refused(store: Path) -> None:
    """A state saved mid-epoch by a pre-scheme job resumes byte-identically while that job is
    known, and is refused naming what to do once only a scheme-2 job can serve it."""
    with run_server(store) as srv:
        old_id = _pre_scheme_job(srv)
        with _loader(srv.http_url) as ld:
            ld.set_epoch(1)
            it = iter(ld)
            head = [digest(next(it)) for _ in range(4)]
            state = ld.state_dict()
            rest = [digest(b) for b in it]
        assert ld.job_id == old_id and len(head + rest) == 12
        with _loader(srv.http_url) as again:
            again.load_state_dict(state)
            assert [digest(b) for b in again] == rest
        r = httpx.delete(f"{srv.http_url}/v1/jobs/{old_id}", timeout=scaled(10))
        assert r.status_code in (200, 204), r.text
        with _loader(srv.http_url) as other:
            with pytest.raises(ResumeRefused, match=r"scheme 1.*set_epoch\(1\)"):
                other.load_state_dict(state)
            assert other.job_id != old_id


def _by_sample(url: str, **kw: Any) -> dict[int, bytes]:
    """Every sample's served bytes (image and keyed noise) in epoch 1, by its id."""
    chain = [{"name": "keyed_noise"}, *CIFAR_CHAIN]
    out: dict[int, bytes] = {}
    with Loader(url, "cifar", seed=3, transforms=chain, timeout=scaled(30), **kw) as ld:
        ld.set_epoch(1)
        for b in ld:
            sid, label = b["sid"].numpy(), b["label"].numpy()
            assert (sid % 10 == label).all()
            for i, s in enumerate(sid.tolist()):
                out[s] = b["image"][i].numpy().tobytes() + b["noise"][i].numpy().tobytes()
    return out


@pytest.mark.slow
def test_a_sample_is_augmented_the_same_in_any_batch_rank_world_and_pool(store: Path) -> None:
    """Batch sizes 50 and 32, one rank or two, threads or worker processes: every sample's
    crop, flip and keyed draws are the same bytes."""
    with (
        run_server(store, *MODS, "--transform-pool", "thread") as a,
        run_server(store, *MODS, "--transform-pool", "process", "--transform-workers", "2") as b,
    ):
        ref = _by_sample(a.http_url, batch_size=50)
        assert len(ref) == 600
        assert _by_sample(b.http_url, batch_size=32) == ref
        for rank in (0, 1):
            part = _by_sample(a.http_url, batch_size=20, rank=rank, world_size=2)
            assert len(part) == 300 and all(ref[s] == v for s, v in part.items())
        noise = {s: np.frombuffer(v[-32:], np.float64) for s, v in ref.items()}
        assert len({n.tobytes() for n in noise.values()}) == 600


@pytest.mark.slow
def test_keyed_chain_resumes_byte_identically_on_processes(store: Path) -> None:
    """A scheme-2 chain cut across worker processes resumes from a state_dict byte for byte."""
    from tests.support.resume import assert_resumes_exactly

    with run_server(store, *MODS, "--transform-pool", "process") as srv:

        def make_iter(state: object) -> tuple:
            loader = _loader(srv.http_url)
            if state is not None:
                loader.load_state_dict(state)
            else:
                loader.set_epoch(2)
            return iter(loader), loader.state_dict

        assert_resumes_exactly(make_iter, midpoint=5, key=digest)
