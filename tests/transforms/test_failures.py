"""Every way a transform can go wrong gives its documented error within the deadline:
unknown name and bad params (422 listing what exists), wrong output schema, a raising
transform (TransformError naming transform, dataset, sample, text; the job fails), a hung
worker (killed, replaced), a dying worker; ``on_error="replace"`` serves other samples
deterministically; a worker killed from outside is replaced and nothing is served twice."""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from shardserve.client import BadRequest, Loader
from shardserve.proto.errors import TransformError
from tests.support.data import sample_id_of
from tests.support.server import ServerProc, job_status, run_server
from tests.support.slowness import scaled
from tests.transforms.conftest import MODS, N, alive, digest, pool_status, shm_segments

# The deadline the hang test waits out, stretched on a busy machine. The other tests' server
# keeps the default 30 s (stretched too): a starved worker must not fail a transform that works.
TIMEOUT_S = scaled(3.0)


@contextmanager
def _server(store: Path, timeout_s: float) -> Iterator[ServerProc]:
    with run_server(
        store, *MODS, "--transform-timeout-s", str(timeout_s), "--transform-workers", "2"
    ) as s:
        yield s
        pids = pool_status(s.http_url)["pool"]["pids"]
        s.terminate()
        assert all(not alive(p) for p in pids), "a transform worker outlived its server"
        assert not shm_segments(s.proc.pid), "the server left shared memory behind"


@pytest.fixture(scope="module")
def srv(store: Path) -> Iterator[ServerProc]:
    with _server(store, scaled(30.0)) as s:
        yield s


def _run(url: str, chain: list, **kw: object) -> list[dict]:
    with Loader(
        url, "cifar", batch_size=50, seed=1, timeout=scaled(20.0), transforms=chain, **kw
    ) as ld:
        ld.set_epoch(0)
        return list(ld)


def _ids(batch: dict) -> list[int]:
    return sample_id_of({"image": batch["image"].numpy(), "label": batch["label"].numpy()}).tolist()


def test_unknown_transform_and_bad_params_are_422_listing_what_exists(srv: ServerProc) -> None:
    """An unknown name lists the installed transforms; bad params name the param and the
    schema; a chain that does not fit the dataset names the fields; the Loader raises BadRequest."""

    def post(chain: object) -> httpx.Response:
        return httpx.post(
            f"{srv.http_url}/v1/jobs",
            timeout=scaled(10),
            json={"dataset": "cifar", "batch_size": 8, "transforms": chain},
        )

    r = post([{"name": "hflip", "params": {"layout": "CHW"}}, {"name": "sharpen"}])
    assert r.status_code == 422 and "transforms[1]" in r.text and "'sharpen'" in r.text
    assert "random_crop" in r.text and "py_noise" in r.text  # what exists
    r = post([{"name": "random_crop", "params": {"size": 32, "padding": -1}}])
    assert r.status_code == 422 and "padding" in r.text and "greater than or equal" in r.text
    r = post([{"name": "random_crop", "params": {"size": 32, "colour": 1}}])
    assert r.status_code == 422 and "colour" in r.text
    r = post([{"name": "add_const", "params": {"field": "img"}}])  # its check: inputs["img"]
    assert r.status_code == 422 and "it reads field 'img', which is not there" in r.text
    r = post([{"name": "decode_image"}])  # image is uint8[3,32,32], not bytes
    assert r.status_code == 422 and "not encoded bytes" in r.text
    with pytest.raises(BadRequest, match="no transform named 'nope'"):
        Loader(
            srv.http_url, "cifar", batch_size=8, transforms=[{"name": "nope"}], timeout=scaled(10)
        )
    r = httpx.post(
        f"{srv.http_url}/v1/jobs",
        timeout=scaled(10),
        json={
            "dataset": "cifar",
            "batch_size": 8,
            "collate": "graph",
            "transforms": [{"name": "hflip", "params": {"layout": "CHW"}}],
        },
    )
    # Graphs are collated after the chain: cifar's outputs have nothing to count nodes with.
    assert 400 <= r.status_code < 500 and "count each graph's nodes" in r.text
    with pytest.raises(BadRequest, match="resident mode"):
        Loader(srv.http_url, "cifar", batch_size=8, resident="cpu", transforms=[{"name": "hflip"}])
    listing = pool_status(srv.http_url)["transforms"]
    crop = next(t for t in listing if t["name"] == "random_crop")
    assert "padding" in crop["params"]["properties"] and crop["shape"] == "batch"
    fail = next(t for t in listing if t["name"] == "fail_on")
    assert fail["outputs"] == {"label": {"dtype": "int64", "shape": []}}


def test_wrong_output_schema_names_field_and_both_shapes(srv: ServerProc) -> None:
    """A transform returning another shape than it declared fails with the field and both."""
    t0 = time.monotonic()
    with pytest.raises(TransformError) as e:
        _run(srv.http_url, [{"name": "wrong_shape"}])
    msg = str(e.value)
    assert "'wrong_shape'" in msg and "'label'" in msg and "int64[]" in msg and "int64[2]" in msg
    assert time.monotonic() - t0 < scaled(20.0)


def test_raising_transform_fails_the_job_naming_everything(srv: ServerProc) -> None:
    """TransformError names transform, dataset, sample index and the exception's text; the
    job is failed with the same reason."""
    chain = [{"name": "fail_on", "params": {"every": 7}}]
    with pytest.raises(TransformError) as e:
        _run(srv.http_url, chain, shuffle=False)
    msg = str(e.value)
    # Batches are transformed several at a time: whichever multiple of 7 failed first.
    m = re.search(r"transform 'fail_on' failed on dataset 'cifar' sample (\d+) \(epoch 0\)", msg)
    assert m is not None and int(m[1]) % 7 == 0, msg
    assert f"ValueError: sample {m[1]} is cursed" in msg
    with Loader(
        srv.http_url,
        "cifar",
        batch_size=50,
        seed=1,
        shuffle=False,
        transforms=chain,
        timeout=scaled(20.0),
    ) as ld:
        status = job_status(srv, ld.job_id)
    assert status["state"] == "failed" and "cursed" in status["error"]


def test_on_error_replace_serves_deterministic_other_samples(srv: ServerProc) -> None:
    """With on_error="replace" every batch is full, no failing sample is served, the
    replacements are the same on every run, and they are counted."""
    chain = [{"name": "fail_on", "params": {"every": 7}}]
    before = pool_status(srv.http_url)["counts"].get("replaced", 0)
    runs = [_run(srv.http_url, chain, on_error="replace", shuffle=False) for _ in range(2)]
    ids = [i for b in runs[0] for i in _ids(b)]
    assert len(ids) == N and all(len(b["label"]) == 50 for b in runs[0])
    assert not [i for i in ids if i % 7 == 0]
    assert [digest(b) for b in runs[0]] == [digest(b) for b in runs[1]]
    failing = len(range(0, N, 7))
    assert pool_status(srv.http_url)["counts"]["replaced"] - before >= 2 * failing
    page = httpx.get(f"{srv.http_url}/", timeout=scaled(10)).text
    assert "replaced" in page and "id='transforms'" in page


def test_hanging_worker_is_killed_and_replaced_within_the_deadline(store: Path) -> None:
    """A transform that hangs in a worker process fails the job after --transform-timeout-s
    with a TransformError; the hung worker is killed and a new one takes its place."""
    with _server(store, TIMEOUT_S) as srv:
        _hang_and_recover(srv)


def _hang_and_recover(srv: ServerProc) -> None:
    t0 = time.monotonic()
    with pytest.raises(
        TransformError, match=rf"did not finish within {TIMEOUT_S} s; it was killed"
    ):
        _run(srv.http_url, [{"name": "hang"}])
    took = time.monotonic() - t0
    assert TIMEOUT_S <= took < TIMEOUT_S + scaled(12.0), took
    deadline = time.monotonic() + scaled(20)
    while time.monotonic() < deadline:  # the replacement starts in the background of the error
        st = pool_status(srv.http_url)
        if st["pool"]["processes"] == 2 and st["counts"].get("workers_hung", 0) >= 1:
            break
        time.sleep(0.1)
    assert st["pool"]["processes"] == 2 and st["counts"]["workers_hung"] >= 1, st
    assert (
        'shardserve_transform_worker_restarts_total{reason="hung"}'
        in httpx.get(f"{srv.http_url}/metrics", timeout=scaled(10)).text
    )


def test_worker_that_dies_fails_with_its_exit_code(srv: ServerProc) -> None:
    """A transform that kills its worker (twice: retried once) fails with 'died'."""
    with pytest.raises(TransformError, match=r"died \(exit code 3\) twice"):
        _run(srv.http_url, [{"name": "suicide"}])


def test_a_failed_chain_is_counted_under_a_bounded_label(srv: ServerProc) -> None:
    """A chain that fails as a whole is counted as ``transform="(chain)"``: label values are
    installed transforms' names, never the client's chain spelled out."""
    with pytest.raises(TransformError, match=r"died \(exit code 3\)"):
        _run(srv.http_url, [{"name": "slow", "params": {"seconds": 0.001}}, {"name": "suicide"}])
    text = httpx.get(f"{srv.http_url}/metrics", timeout=scaled(10)).text
    assert 'shardserve_transform_errors_total{transform="(chain)"}' in text
    assert "slow,suicide" not in text


def test_worker_killed_from_outside_is_replaced_and_nothing_served_twice(srv: ServerProc) -> None:
    """kill -9 of a worker mid-epoch: its piece is retried on a fresh worker; the epoch has
    every sample exactly once and the same bytes as an undisturbed run."""
    chain = [{"name": "slow", "params": {"seconds": 0.004}}]
    ref = [digest(b) for b in _run(srv.http_url, chain)]
    died = pool_status(srv.http_url)["counts"].get("workers_died", 0)
    got, ids = [], []
    with Loader(
        srv.http_url,
        "cifar",
        batch_size=50,
        seed=1,
        timeout=scaled(20),
        transforms=chain,
        prefetch=1,
    ) as ld:
        ld.set_epoch(0)
        for i, b in enumerate(ld):
            got.append(digest(b))
            ids += _ids(b)
            if i == 2:
                os.kill(pool_status(srv.http_url)["pool"]["pids"][0], signal.SIGKILL)
    assert got == ref
    assert sorted(Counter(ids).values()) == [1] * N
    assert pool_status(srv.http_url)["counts"].get("workers_died", 0) >= died


def test_a_worker_that_cannot_load_the_modules_fails_the_job_naming_them(
    store: Path, no_leftovers: list[int]
) -> None:
    """A transform module that imports in the server but not in a worker process fails the
    job with a TransformError naming the modules, and leaves no worker and no file behind."""
    with run_server(store, "--transforms", "tests.transforms.worker_refuses") as s:
        no_leftovers.append(s.proc.pid)
        with (
            pytest.raises(
                TransformError,
                match=r"exited while loading transform modules.*"
                r"worker_refuses",
            ),
            Loader(
                s.http_url, "cifar", 50, timeout=scaled(60), transforms=[{"name": "same_label"}]
            ) as ld,
        ):
            list(ld)
        assert pool_status(s.http_url)["pool"]["processes"] == 0
