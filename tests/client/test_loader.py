"""The Loader against a real server: plans, epochs, resume, tensors, stats."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import httpx
import numpy as np
import pytest
import torch

from shardserve.client import DatasetNotFound, Loader, VarTensor
from shardserve.server.planning import plan
from shardserve.server.store.catalog import Store
from tests.client.conftest import N_CIFAR, ids
from tests.support.data import cifar_images, make_cifar_like
from tests.support.resume import assert_resumes_exactly
from tests.support.server import run_server
from tests.support.slowness import scaled


def test_single_rank_epoch_equals_the_plan(server, store) -> None:
    """One rank's epoch is the planner's batches, in order, with the store's exact bytes."""
    with Loader(server.http_url, "cifar", 64, seed=3, rank=0, world_size=1) as loader:
        loader.set_epoch(2)
        batches = list(loader)
        assert len(batches) == len(loader)
    want = plan(N_CIFAR, seed=3, epoch=2, world_size=1, rank=0, batch_size=64)
    assert [ids(b) for b in batches] == [tuple(int(i) for i in b) for b in want]
    with Store(store).open("cifar") as ds:
        ref = ds.take(want.batch(3))
    assert torch.equal(batches[3]["image"], torch.from_numpy(ref["image"]))
    assert torch.equal(batches[3]["label"], torch.from_numpy(ref["label"]))
    assert batches[3]["image"].dtype == torch.uint8 and batches[3]["image"].shape == (64, 3, 32, 32)


def test_a_loader_nothing_holds_serves_its_whole_epoch(server) -> None:
    """``for batch in Loader(...)``: the loop holds only the iterator, which keeps its Loader
    (and so its stream) alive to the epoch's end; after it the Loader is collected."""
    got = []
    for batch in Loader(server.http_url, "cifar", 64, seed=3, rank=0, world_size=1):
        gc.collect()  # a Loader held by nothing would be closed here
        got.append(ids(batch))
    want = plan(N_CIFAR, seed=3, epoch=0, world_size=1, rank=0, batch_size=64)
    assert got == [tuple(int(i) for i in b) for b in want]
    it = iter(Loader(server.http_url, "cifar", 64, seed=3, rank=0, world_size=1))
    ref = weakref.ref(it.owner)  # type: ignore[attr-defined]
    del it
    gc.collect()
    assert ref() is None


def test_set_epoch_changes_the_order_and_the_seed_reproduces_it(server) -> None:
    """Epochs differ, the same (seed, epoch) gives the same order, and iterating again without
    set_epoch advances the epoch instead of repeating it."""
    with (
        Loader(server.http_url, "cifar", 100, seed=7, rank=0, world_size=1) as a,
        Loader(server.http_url, "cifar", 100, seed=7, rank=0, world_size=1) as b,
    ):
        a.set_epoch(0)
        e0 = [ids(x) for x in a]
        e1_auto = [ids(x) for x in a]  # no set_epoch: advances to epoch 1
        b.set_epoch(1)
        e1 = [ids(x) for x in b]
        b.set_epoch(0)
        assert [ids(x) for x in b] == e0
    assert e0 != e1 and e1_auto == e1
    assert sorted(i for bt in e0 for i in bt) == list(range(N_CIFAR))


@pytest.mark.parametrize("midpoint", [0, 4, 9])
def test_resume_mid_epoch_yields_exactly_the_rest(server, midpoint: int) -> None:
    """A state_dict taken after `midpoint` batches resumes with exactly the remaining batches."""
    # After the last batch the state is the next epoch's start: see test_epochs.py.
    loaders: list[Loader] = []

    def make_iter(state):
        loader = Loader(server.http_url, "cifar", 100, seed=1, rank=0, world_size=1, prefetch=3)
        loaders.append(loader)
        if state is not None:
            loader.load_state_dict(state)
        else:
            loader.set_epoch(5)
        return iter(loader), loader.state_dict

    try:
        assert_resumes_exactly(make_iter, midpoint, key=ids)
    finally:
        for loader in loaders:
            loader.close()


def test_state_dict_after_an_epoch_points_at_the_next(server) -> None:
    """After a full epoch the state says: next epoch, batch 0; a foreign state is refused."""
    with Loader(server.http_url, "cifar", 250, rank=0, world_size=1) as loader:
        loader.set_epoch(4)
        for _ in loader:
            pass
        st = loader.state_dict()
        assert (st["epoch"], st["next_batch"], st["position"], st["version"]) == (5, 0, 0, 2)
        with pytest.raises(ValueError, match="'world_size' is 2 but its spec says world_size 1"):
            loader.load_state_dict({**st, "rank": 1, "world_size": 2})
        with pytest.raises(
            ValueError, match=r"another job \(seed=1 in the state, 0 in this loader"
        ):
            loader.load_state_dict({**st, "spec": {**st["spec"], "seed": 1}})


def test_a_state_saved_before_an_overwrite_is_refused_on_the_new_version(tmp_path) -> None:
    """``ingest --overwrite`` with as many samples: a state saved mid-epoch on the old version
    is refused by a Loader of the new one, naming both versions, instead of resuming at the
    same position of other data; the old version's own Loader still resumes it."""
    store = tmp_path / "store"
    make_cifar_like(store, "versioned", n=400)
    src = tmp_path / "new.npz"
    np.savez(src, image=cifar_images(0, 400, seed=7), label=np.arange(400, dtype=np.int64) % 10)
    with run_server(store) as srv:
        old = Loader(srv.http_url, "versioned", 50, seed=1, rank=0, world_size=1)
        it = iter(old)
        for _ in range(3):
            next(it)
        st = old.state_dict()
        assert isinstance(st["versions"], str) and st["versions"]
        subprocess.run(
            [
                sys.executable,
                "-m",
                "shardserve.server",
                "ingest",
                str(src),
                "--store",
                str(store),
                "--name",
                "versioned",
                "--overwrite",
                "--quiet",
            ],
            check=True,
            timeout=scaled(120),
            capture_output=True,
        )
        with Loader(srv.http_url, "versioned", 50, seed=1, rank=0, world_size=1) as new:
            assert new.job_id != old.job_id
            said = f"version {st['versions']}, but this loader's job reads version"
            with pytest.raises(ValueError, match=said):
                new.load_state_dict(st)
        old.load_state_dict(st)  # its own version: resumes at batch 3
        assert len(list(old)) == len(old) - 3
        old.close()


def test_variable_fields_arrive_as_vartensor_or_padded(server) -> None:
    """Graph-like samples come back as VarTensor (values/offsets/shapes) or padded + lengths."""
    with Loader(server.http_url, "graphs", 16, shuffle=False, rank=0, world_size=1) as loader:
        batch = next(iter(loader))
    x = batch["x"]
    assert isinstance(x, VarTensor) and len(x) == 16 and x.shapes.shape == (16, 2)
    assert torch.equal(batch["y"], torch.arange(16, dtype=torch.float32))
    smiles = [bytes(t.numpy()) for t in batch["smiles"].unbind()]
    assert smiles[3].endswith(b"#3")
    with Loader(
        server.http_url, "graphs", 16, shuffle=False, rank=0, world_size=1, pad_variable=True
    ) as loader:
        padded = next(iter(loader))
    assert padded["x"].shape == (16, int(x.shapes[:, 0].max()), 8)
    assert torch.equal(padded["x.lengths"], x.shapes)
    assert torch.equal(padded["x"][3, : x.shapes[3, 0]], x.unbind()[3])


def test_stats_account_for_every_batch(server) -> None:
    """stats() counts batches and bytes delivered and splits time into wait and compute."""
    with Loader(server.http_url, "cifar", 200, rank=0, world_size=1) as loader:
        n = sum(1 for _ in loader)
        s = loader.stats()
    assert s.batches == n == 5
    assert s.bytes == N_CIFAR * (3 * 32 * 32 + 8)
    assert 0.0 <= s.stall_fraction <= 1.0 and s.first_batch_s is not None
    # Same host: the default transport is shared memory.
    assert s.transport == "shm" and s.reconnects == 0
    with Loader(server.http_url, "cifar", 200, transport="socket") as loader:
        sum(1 for _ in loader)
        assert loader.stats().transport == "ipc"


def test_unknown_dataset_is_a_typed_error(server) -> None:
    """A Loader for a dataset the store lacks raises DatasetNotFound naming it, at construction."""
    with pytest.raises(DatasetNotFound, match="nope"):
        Loader(server.http_url, "nope", 8)


def test_tcp_transport_delivers_the_same_batches(server) -> None:
    """transport='tcp' and the same-host ipc path deliver identical batches."""
    with (
        Loader(server.http_url, "cifar", 128, seed=9, rank=0, world_size=1, transport="tcp") as t,
        Loader(server.http_url, "cifar", 128, seed=9, rank=0, world_size=1) as i,
    ):
        assert t.stats().transport == "tcp" and i.stats().transport == "ipc"
        for bt, bi in zip(t, i, strict=True):
            assert torch.equal(bt["image"], bi["image"]) and torch.equal(bt["label"], bi["label"])


def test_control_plane_epoch_is_followed_unless_set_epoch(server) -> None:
    """Without set_epoch a Loader starts at the job's epoch set over HTTP; set_epoch overrides it;
    a second iterator replaces the first, which then refuses to go on."""
    kw = {"seed": 11, "rank": 0, "world_size": 1}
    with Loader(server.http_url, "cifar", 125, **kw) as first:
        r = httpx.put(
            f"{server.http_url}/v1/jobs/{first.job_id}/epoch", json={"epoch": 7}, timeout=scaled(5)
        )
        assert r.status_code == 200, r.text
        with Loader(server.http_url, "cifar", 125, **kw) as loader:
            e7 = [ids(b) for b in loader]
            assert loader.state_dict()["epoch"] == 8
            loader.set_epoch(7)
            old = iter(loader)
            next(old)
            e8 = [ids(b) for b in loader]  # a new iterator advances to epoch 8
            with pytest.raises(RuntimeError, match="replaced"):
                next(old)
            loader.set_epoch(7)
            assert [ids(b) for b in loader] == e7 != e8
    want = plan(N_CIFAR, seed=11, epoch=7, world_size=1, rank=0, batch_size=125)
    assert e7 == [tuple(int(i) for i in b) for b in want]
