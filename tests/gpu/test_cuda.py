"""The CUDA delivery paths on a real GPU: registered shm rings, pinned staging, event-gated
slot return, memory over many epochs, a server killed mid-epoch, and resident mode.

Every test here is marked ``cuda`` and skipped where ``torch.cuda.is_available()`` is
False (CI has no GPU); they run on a GPU machine with ``python -m pytest -m cuda tests/gpu``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from shardserve.client import Loader, ResidentTooLarge
from shardserve.proto.manifest import FieldSpec
from shardserve.server.planning import plan
from shardserve.server.store.write.writer import ShardWriter
from tests.reliability.test_restart import _Restarter
from tests.support.data import cifar_images, make_cifar_like, sample_id_of
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

pytestmark = pytest.mark.cuda

N = 2000
BATCH = 100


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpu-store")
    make_cifar_like(root, "cifar", n=N)
    return root


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProc]:
    with run_server(store) as srv:
        yield srv


@pytest.fixture(scope="module")
def image_sums() -> torch.Tensor:
    """Sum of every sample's image bytes, by sample id: what an intact batch must add up to."""
    return torch.from_numpy(cifar_images(0, N).reshape(N, -1).astype(np.int64).sum(axis=1))


def _ids(batch: dict) -> list[int]:
    cpu = {k: v.cpu().numpy() for k, v in batch.items()}
    return sample_id_of(cpu).tolist()


def _plan_ids(seed: int, epoch: int) -> list[list[int]]:
    return [b.tolist() for b in plan(N, seed, epoch, 1, 0, BATCH)]


@pytest.mark.parametrize(
    ("transport", "copy", "expect"),
    [("auto", True, "shm"), ("auto", False, "shm"), ("ipc", True, "ipc"), ("tcp", True, "tcp")],
)
def test_cuda_batches_equal_the_cpu_path(server, transport: str, copy: bool, expect: str) -> None:
    """device="cuda" over a registered shm ring, or ipc/tcp through pinned staging: the same
    bytes as the CPU path, on the GPU, in the plan's order."""
    kw = dict(seed=3, rank=0, world_size=1, transport=transport)
    with Loader(server.http_url, "cifar", BATCH, **kw) as cpu:
        cpu.set_epoch(1)
        want = [{k: v.clone() for k, v in b.items()} for b in cpu]
    with Loader(server.http_url, "cifar", BATCH, device="cuda", copy=copy, **kw) as gpu:
        gpu.set_epoch(1)
        got = [{k: v.cpu() for k, v in b.items()} for b in gpu]
        assert gpu.stats().transport == expect
        if expect == "shm":
            ring = gpu._rings.ring
            assert ring is not None and ring.registered, "the shm ring was not cudaHostRegister'ed"
    assert len(got) == len(want) == len(_plan_ids(3, 1))
    for g, w in zip(got, want, strict=True):
        for k in w:
            assert torch.equal(g[k], w[k]), k
    assert [_ids(b) for b in got] == _plan_ids(3, 1)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_slow_consumer_stream_never_sees_an_overwritten_batch(
    server, image_sums: torch.Tensor, transport: str
) -> None:
    """The GPU lags ~10 ms a batch behind the host, copies included: slot and pinned-buffer
    reuse must wait for the copies' events, or batches come out mixed, within an
    epoch and across the next epoch's stream (which reuses the ring)."""
    expected = []
    got = []
    deferred = 0
    with Loader(
        server.http_url,
        "cifar",
        BATCH,
        seed=8,
        rank=0,
        world_size=1,
        device="cuda",
        prefetch=4,
        transport=transport,
    ) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            for batch in loader:
                # Both the consumer's stream and the copy stream run far behind the host: slot
                # and pinned-buffer reuse can only be safe by waiting for the copy events.
                torch.cuda._sleep(20_000_000)
                with torch.cuda.stream(loader._feed.copier._stream):
                    torch.cuda._sleep(20_000_000)
                got.append(batch["image"].view(len(batch["image"]), -1).to(torch.int64).sum(1))
                ring = loader._ctx.rings.ring
                deferred = max(deferred, ring.ledger.copies_in_flight if ring is not None else 0)
            expected += [image_sums[torch.tensor(ids)] for ids in _plan_ids(8, epoch)]
        torch.cuda.synchronize()
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(g.cpu(), e), f"batch {i} does not hold its samples' bytes"
    if transport == "auto":
        # A slot outlived the next() after its own: its return waited for its copy event.
        assert deferred >= 2, "no slot return was ever deferred: the test proved nothing"


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_no_growth_of_pinned_or_device_memory_over_many_epochs(server, transport: str) -> None:
    readings = []
    with Loader(
        server.http_url,
        "cifar",
        BATCH,
        seed=1,
        rank=0,
        world_size=1,
        device="cuda",
        transport=transport,
    ) as loader:
        for epoch in range(10):
            loader.set_epoch(epoch)
            for batch in loader:
                batch["image"].float().mean()
            torch.cuda.synchronize()
            pool = loader._feed.copier.pool.stats()
            readings.append(
                (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), pool["allocated"])
            )
    warm = readings[2]
    for epoch, r in enumerate(readings[3:], start=3):
        assert r[0] <= warm[0] + (1 << 20), f"device memory grew by epoch {epoch}: {readings}"
        assert r[1] <= warm[1], f"reserved device memory grew by epoch {epoch}: {readings}"
        assert r[2] <= warm[2], f"pinned blocks grew by epoch {epoch}: {readings}"


@pytest.mark.parametrize("transport", ["auto", "ipc"])
def test_gpu_epoch_survives_a_kill9_restart(store: Path, tmp_path: Path, transport: str) -> None:
    """The server is killed mid-epoch while batches are copied to the GPU; after a restart on the
    same ports the epoch arrives exactly once, in the plan's order."""
    with _Restarter(store, tmp_path) as r:
        srv = r.start()
        loader = Loader(
            srv.http_url,
            "cifar",
            BATCH,
            seed=4,
            rank=0,
            world_size=1,
            device="cuda",
            prefetch=2,
            timeout=scaled(30.0),
            transport=transport,
        )
        try:
            loader.set_epoch(0)
            got = []
            for i, batch in enumerate(loader):
                got.append(_ids(batch))
                if i == 5:
                    r.crash_and_restart()
        finally:
            loader.close()
    assert got == _plan_ids(4, 0)
    assert loader.stats().reconnects >= 1


def test_resident_cuda_equals_streaming(server) -> None:
    kw = dict(seed=6, rank=0, world_size=1, shuffle="block")
    with Loader(server.http_url, "cifar", BATCH, **kw) as streamed:
        streamed.set_epoch(2)
        want = [{k: v.clone() for k, v in b.items()} for b in streamed]
    with Loader(server.http_url, "cifar", BATCH, resident="cuda", **kw) as resident:
        resident.set_epoch(2)
        got = list(resident)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for k in w:
            assert g[k].is_cuda and torch.equal(g[k].cpu(), w[k])


def test_resident_envs_on_the_gpu_never_alias(server) -> None:
    with Loader(
        server.http_url,
        "cifar",
        32,
        seed=2,
        rank=0,
        world_size=1,
        resident="cuda",
        envs=4,
        devices=["cuda:0"],
    ) as loader:
        loader.set_epoch(0)
        steps = list(loader)
    ptrs = [t.untyped_storage().data_ptr() for s in steps[:5] for b in s for t in b.values()]
    assert len(set(ptrs)) == len(ptrs)
    assert all(t.is_cuda for s in steps for b in s for t in b.values())
    for env in range(4):
        got = sorted(i for s in steps for i in _ids(s[env]))
        assert got == list(range(N))


def test_resident_refuses_when_the_dataset_does_not_fit(server, store: Path) -> None:
    """With the GPU filled to under 64 MiB, a 100 MiB dataset is refused before any allocation."""
    with ShardWriter(
        store, "big", fields=(FieldSpec(name="x", dtype="uint8", shape=(1 << 20,)),)
    ) as w:
        w.add_batch({"x": np.zeros((100, 1 << 20), dtype=np.uint8)})
    hogs = []
    for _ in range(16):
        free, _ = torch.cuda.mem_get_info()
        if free < (48 << 20):
            break
        for size in (free - (32 << 20), free // 2):
            try:
                hogs.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
                break
            except torch.OutOfMemoryError:
                continue
    left, _ = torch.cuda.mem_get_info()
    try:
        assert left < (64 << 20), f"could not fill the GPU: {left} bytes still free"
        with pytest.raises(ResidentTooLarge, match=r"needs 100\.0 MiB resident on cuda:0"):
            Loader(server.http_url, "big", 10, resident="cuda", rank=0, world_size=1)
    finally:
        hogs.clear()
        torch.cuda.empty_cache()
