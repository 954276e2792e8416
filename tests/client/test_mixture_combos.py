"""Mixtures combined with the other job options, each against its plain form's contract: a
shared mixture's subscribers get the unshared Loader's bytes, assembled once. Real server, real
Loaders (threads of this process)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from shardserve.client import Loader
from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

#: Source name -> (samples, the seed its images were drawn with).
SOURCES = {"web": (900, 0), "code": (600, 1), "math": (200, 2)}
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}
BATCH, EPOCH_SAMPLES = 32, 1280  # 40 batches on one rank
WAIT_S = 90.0

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
    args: dict[str, Any] = {"seed": 5, "epoch_samples": EPOCH_SAMPLES, "prefetch": 8,
                            "timeout": scaled(45.0), "token": srv.token} | kw  # fmt: skip
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
