"""A remote store serves the same bytes as a local one: every dataset layout and every way of
reading it, through a real server on each store and a real Loader, batch for batch.

Each dataset's source is written once and ingested once, into the local store, by the library
ingest the CLI runs (``ingest`` for a source, ``ShardWriter`` for the generated sets); the
``file://`` store then gets that same folder the way ``shardserve ingest --store URI``
publishes it (``RemotePublisher.upload``: shards first, manifest last). One server serves the
folder; two serve the URI, one through a cache that keeps every shard, one through a cache
smaller than a shard, which evicts and fetches again as it goes. Every case reads two epochs
from the local server and from a remote one with the same arguments, and compares them byte
for byte: the same tree, types and keys, and every tensor (a :class:`VarTensor`'s values,
offsets and shapes; a :class:`Masked`'s values, missing rows included, and mask) of the same
dtype, shape and bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardserve.client import Loader, LoaderStats, Masked, Texts, VarTensor
from shardserve.server.store.cache import cache_key
from shardserve.server.store.ingest.run import ingest
from shardserve.server.store.layout import read_manifest
from shardserve.server.store.remote.publish import RemotePublisher
from shardserve.server.store.remote.stores import RemoteStore
from tests.support.data import make_cifar_like, make_graph_like
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

N = 240
SEED = 7
#: The first reads the remote shards cold (fetched into the cache), the second warm.
EPOCHS = (1, 2)
#: CIFAR's recipe on the test data (CHW uint8), built-in batch transforms with random draws.
CIFAR_CHAIN = [
    {"name": "random_crop", "params": {"size": 32, "padding": 4, "layout": "CHW"}},
    {"name": "hflip", "params": {"layout": "CHW"}},
    {
        "name": "normalize",
        "params": {"layout": "CHW", "scale": 1 / 255, "mean": [0.5] * 3, "std": [0.25] * 3},
    },
]
#: A built-in sample transform with random draws: 3 random rows of each variable-length seq.
SUBSET_CHAIN = [{"name": "random_subset", "params": {"field": "seq", "n": 3}}]
#: Below every dataset's size (and most of their shards'): the cache evicts all the time.
EVICTING_CACHE_BYTES = 8 << 10


# -- sources ----------------------------------------------------------------------------------
def _nested(i: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    return {
        "image": torch.randint(0, 256, (3, 8, 8), generator=g, dtype=torch.uint8),
        "meta": {
            "id": torch.tensor(i),
            "pos": torch.randn(3, generator=g),
            "deep": {"w": torch.randn(2, 2, generator=g).half(), "flag": torch.tensor(i % 2 == 0)},
        },
        "pair": (torch.full((2,), i, dtype=torch.int32), torch.tensor(float(i)).double()),
        "name": f"sample-{i}-é",
    }


def _nullable(i: int) -> dict[str, Any]:
    """``p`` missing in every third sample; ``bc`` (a variable member) only from sample 40 on,
    so small shards written before it are rewritten with it missing."""
    g = torch.Generator().manual_seed(1000 + i)
    return {
        "a": torch.arange(3, dtype=torch.float32) + i,
        "p": None if i % 3 == 0 else {"nu": torch.full((2,), i + 0.5), "k": torch.tensor(i)},
        "bc": None if i < 40 or i % 5 == 0 else {"left": torch.randn(i % 4 + 1, generator=g)},
    }


def _variable(i: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(2000 + i)
    rows = 3 + i % 10
    return {
        "seq": torch.randn(rows, 4, generator=g),
        "tokens": torch.randint(0, 1000, (i % 7,), generator=g),
        "grid": torch.randint(0, 9, (1 + i % 3, 2 + i % 4), generator=g, dtype=torch.int16),
        "label": torch.tensor(i % 10),
    }


def _nullable_table(n: int) -> pa.Table:
    """An Arrow table whose struct, fixed-list, string and scalar columns have nulls."""
    return pa.table(
        {
            "a": np.arange(n, dtype=np.float32),
            "p": pa.array(
                [
                    None if i % 3 == 0 else {"nu": float(i), "re": [float(i), -1.0]}
                    for i in range(n)
                ],
                type=pa.struct([("nu", pa.float32()), ("re", pa.list_(pa.float32(), 2))]),
            ),
            "s": pa.array([None if i % 6 == 0 else f"t{i}" for i in range(n)]),
            "c": pa.array([None if i % 4 == 1 else i for i in range(n)], type=pa.int64()),
        }
    )


def _pt_folder(folder: Path, samples: Iterator[Any]) -> Path:
    folder.mkdir()
    for i, s in enumerate(samples):
        torch.save(s, folder / f"{i:04d}.pt")
    return folder


@dataclass
class Stores:
    local: Path
    remote: str  # a file:// URI
    tmp: Path


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Stores:
    """Every dataset written once, ingested into the local store, published to the URI."""
    tmp = tmp_path_factory.mktemp("matrix")
    src, local = tmp / "src", tmp / "local"
    src.mkdir()
    local.mkdir()
    # Small shards: every dataset spans several, so a batch gathers from more than one.
    make_cifar_like(local, "cifar", n=N, shard_bytes=64 << 10)
    make_graph_like(local, "graphs", n=N, shard_bytes=8 << 10)
    kw: dict[str, Any] = {"progress": False}
    ingest(
        _pt_folder(src / "nested", map(_nested, range(N))),
        local,
        "nested",
        shard_bytes=8 << 10,
        **kw,
    )
    ingest(
        _pt_folder(src / "nullable", map(_nullable, range(N))),
        local,
        "nullable",
        shard_bytes=1 << 10,
        **kw,
    )
    ingest(
        _pt_folder(src / "variable", map(_variable, range(N))),
        local,
        "variable",
        shard_bytes=4 << 10,
        **kw,
    )
    pq.write_table(_nullable_table(N), src / "nullable.parquet")
    ingest(src / "nullable.parquet", local, "nullarrow", shard_bytes=1 << 10, **kw)
    remote = RemoteStore((tmp / "remote").as_uri())
    try:
        for name in ("cifar", "graphs", "nested", "nullable", "variable", "nullarrow"):
            RemotePublisher(remote).upload(local / name, name, overwrite=False)
    finally:
        remote.close()
    return Stores(local, (tmp / "remote").as_uri(), tmp)


@dataclass
class Servers:
    local: ServerProc
    #: Servers of the URI: ``cached`` keeps every shard it fetched; ``evicting``'s cache is
    #: smaller than most shards (they are fetched, evicted and fetched again).
    remote: dict[str, ServerProc]
    cache: dict[str, Path]
    #: Each case's reading of the local store (read once, compared with each remote).
    local_reads: dict[str, tuple[list[Any], LoaderStats]] = field(default_factory=dict)
    #: The datasets each remote server has read so far.
    seen: dict[str, set[str]] = field(default_factory=dict)


REMOTES = {"cached": (), "evicting": ("--cache-limit-bytes", str(EVICTING_CACHE_BYTES))}


@pytest.fixture(scope="module")
def servers(stores: Stores) -> Iterator[Servers]:
    """A server on the local folder and two on the file:// URI (through their shard caches)."""
    cache = {kind: stores.tmp / f"cache-{kind}" for kind in REMOTES}
    with contextlib.ExitStack() as stack:
        local = stack.enter_context(run_server(stores.local))
        remote = {
            kind: stack.enter_context(
                run_server(stores.remote, "--cache-dir", str(cache[kind]), *args)  # type: ignore[arg-type]
            )
            for kind, args in REMOTES.items()
        }
        yield Servers(local, remote, cache)


def metric(srv: ServerProc, name: str) -> float:
    text = httpx.get(f"{srv.http_url}/metrics", timeout=scaled(10)).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} not in /metrics")


# -- comparison -------------------------------------------------------------------------------
def _assert_same_tensor(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g = got.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    w = want.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(g, w):
        diff = (g != w).nonzero().flatten()
        raise AssertionError(
            f"{where}: {diff.numel()} of {w.numel()} bytes differ, first at byte "
            f"{int(diff[0])}; remote {got.flatten()[:8].tolist()} vs local "
            f"{want.flatten()[:8].tolist()}"
        )


def assert_same_batch(got: Any, want: Any, where: str) -> None:
    """``got`` (remote) is ``want`` (local) byte for byte, in the same structure."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        _assert_same_tensor(got, want, where)
    elif isinstance(want, VarTensor):
        for part in ("values", "offsets", "shapes"):
            _assert_same_tensor(getattr(got, part), getattr(want, part), f"{where}.{part}")
    elif isinstance(want, Masked):
        _assert_same_tensor(got.mask, want.mask, f"{where}.mask")
        assert_same_batch(got.values, want.values, f"{where}.values")
    elif isinstance(want, Mapping):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same_batch(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):  # a tuple field, Texts, the env batches of a step
        assert len(got) == len(want), f"{where}: {len(got)} items != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_batch(g, w, f"{where}[{i}]")
    else:  # a str of Texts, None
        assert got == want, f"{where}: {got!r} != {want!r}"


# -- the matrix -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    dataset: str
    batch_size: int
    loader: dict[str, Any] = field(default_factory=dict)


#: Graphs collated on the server for message passing (the binary smiles left out).
GRAPH: dict[str, Any] = {"collate": "graph", "fields": ["x", "edge_index", "y"]}
CASES = {
    "flat": Case("cifar", 32, {"prefetch": 1}),
    "flat_tcp": Case("cifar", 32, {"prefetch": 1, "transport": "tcp"}),
    "flat_block_shuffle": Case("cifar", 32, {"prefetch": 1, "shuffle": "block"}),
    "flat_store_order": Case("cifar", 32, {"prefetch": 1, "shuffle": False}),
    "flat_drop_last": Case("cifar", 36, {"prefetch": 1, "drop_last": True}),
    "flat_rank1_of_2": Case("cifar", 32, {"prefetch": 1, "rank": 1, "world_size": 2}),
    "nested": Case("nested", 16, {"prefetch": 1}),
    "nullable_pt": Case("nullable", 16, {"prefetch": 1}),
    "nullable_arrow": Case("nullarrow", 16, {"prefetch": 1}),
    "variable": Case("variable", 16, {"prefetch": 1}),
    "variable_padded": Case("variable", 16, {"prefetch": 1, "pad_variable": True}),
    "nullable_padded": Case("nullable", 16, {"prefetch": 1, "pad_variable": True}),
    "graph": Case("graphs", 12, {"prefetch": 1, **GRAPH}),
    "transforms_batch": Case("cifar", 32, {"prefetch": 1, "transforms": CIFAR_CHAIN}),
    "transforms_sample": Case("variable", 16, {"prefetch": 1, "transforms": SUBSET_CHAIN}),
    "grouped": Case("cifar", 8),  # prefetch left to the Loader: up to 64 small batches
    "grouped_variable": Case("variable", 4, {"prefetch": 64}),
    "grouped_graph": Case("graphs", 5, {"prefetch": 64, **GRAPH}),
    "envs": Case("cifar", 16, {"envs": 3}),
    "resident": Case("cifar", 32, {"resident": "cpu"}),
    "envs_nullable": Case("nullable", 8, {"envs": 2, "fields": ["a", "p.nu", "p.k"]}),
}


def _read(url: str, case: Case) -> tuple[list[Any], LoaderStats]:
    """Epochs ``EPOCHS`` of ``case`` from the server at ``url``, as a user reads them."""
    kw = {"seed": SEED, "rank": 0, "world_size": 1, "timeout": 60, **case.loader}
    with Loader(url, case.dataset, case.batch_size, **kw) as loader:
        batches: list[Any] = []
        for epoch in EPOCHS:
            loader.set_epoch(epoch)
            got = list(loader)
            assert len(got) == len(loader), f"epoch {epoch}: {len(got)} of {len(loader)} batches"
            batches += got
        return batches, loader.stats()


def _leaves(batch: Any) -> Iterator[Any]:
    if isinstance(batch, Mapping):
        for v in batch.values():
            yield from _leaves(v)
    elif isinstance(batch, (list, tuple)) and not isinstance(batch, Texts):
        for v in batch:
            yield from _leaves(v)
    else:
        yield batch


def _check_exercised(name: str, batches: list[Any], stats: LoaderStats) -> None:
    """A reading really has what the case is about (the matrix is not vacuous)."""
    leaves = [leaf for b in batches for leaf in _leaves(b)]
    if "nullable" in name:
        masks = [leaf.mask for leaf in leaves if isinstance(leaf, Masked)]
        assert masks and any(not bool(m.all()) for m in masks), f"{name}: nothing masked"
    if name == "nested":
        b = batches[0]
        assert isinstance(b["name"], Texts) and isinstance(b["pair"], tuple), b
        assert isinstance(b["meta"]["deep"]["w"], torch.Tensor), b
    if name in ("variable", "grouped_variable"):
        assert any(isinstance(leaf, VarTensor) for leaf in leaves), f"{name}: no VarTensor"
    if name == "variable_padded":
        assert "seq.lengths" in batches[0] and not any(isinstance(v, VarTensor) for v in leaves)
    if name == "nullable_padded":
        left = batches[-1]["bc"]["left"]
        assert isinstance(left, Masked) and isinstance(left.values, torch.Tensor), left
    if "graph" in name:
        assert {"batch", "ptr"} <= set(batches[0]), f"{name}: not a graph batch"
    if name == "transforms_batch":
        assert batches[0]["image"].dtype == torch.float32
    if name == "transforms_sample":
        assert batches[0]["seq"].shape == (16, 3, 4)
    if name.startswith("envs"):
        envs = CASES[name].loader["envs"]
        assert all(isinstance(b, list) and len(b) == envs for b in batches), name
    if name.startswith("resident"):
        assert stats.transport == "resident" and stats.messages == 0, f"{name}: {stats}"
    elif name.startswith("grouped"):
        assert stats.messages < stats.batches, f"{name}: one batch per message ({stats})"
    elif not name.startswith("envs"):
        assert stats.messages == stats.batches, f"{name}: {stats}"


#: The evicting cache reads one case of each dataset (its shards fetched, evicted, fetched
#: again); the roomy one every case.
EVICTING_CASES = (
    "flat_block_shuffle",
    "nested",
    "nullable_pt",
    "nullable_arrow",
    "variable",
    "graph",
    "transforms_sample",
    "grouped_variable",
)
MATRIX = [
    *(pytest.param("cached", name, id=f"cached-{name}") for name in CASES),
    *(pytest.param("evicting", name, id=f"evicting-{name}") for name in EVICTING_CASES),
]


@pytest.mark.parametrize(("remote", "name"), MATRIX)
def test_a_remote_store_reads_byte_equal_to_a_local_one(
    stores: Stores, servers: Servers, remote: str, name: str
) -> None:
    case = CASES[name]
    if name not in servers.local_reads:
        servers.local_reads[name] = _read(servers.local.http_url, case)
        _check_exercised(name, *servers.local_reads[name])
    want, want_stats = servers.local_reads[name]
    srv = servers.remote[remote]
    fetched = metric(srv, "shardserve_cache_fetches_total")
    got, got_stats = _read(srv.http_url, case)
    _check_exercised(name, got, got_stats)
    assert len(got) == len(want), f"{name}: {len(got)} batches from remote, {len(want)} local"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same_batch(g, w, f"{name} batch {i}")
    assert got_stats.batches == want_stats.batches
    # The remote server read the URI, through its cache: the first case of a dataset fetched
    # every shard (an epoch touches them all).
    shards = read_manifest(stores.local / case.dataset).shards
    seen = servers.seen.setdefault(remote, set())
    if case.dataset not in seen:
        now = metric(srv, "shardserve_cache_fetches_total")
        assert now - fetched >= len(shards), f"{name}: {now - fetched} of {len(shards)} fetched"
        seen.add(case.dataset)
    if remote == "cached":  # and kept every one
        cache = servers.cache[remote]
        missing = [s.path for s in shards if not (cache / cache_key(s.checksum)).is_file()]
        assert not missing, f"{name}: shards not in the cache: {missing}"
    else:  # and evicted some of them while reading on
        assert metric(srv, "shardserve_cache_evictions_total") > 0
