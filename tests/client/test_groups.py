"""Several small batches per message, against a real server: the loop sees exactly
the batches of one batch per message, each with storages of its own, over every transport,
resumable in the middle of a message; and the cutting itself, property-tested."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.client import Loader, VarTensor
from shardserve.client._cut import cut_rows
from shardserve.proto.errors import ProtocolError
from tests.client.conftest import N_CIFAR, ids


def _storages(batch: dict) -> list[int]:
    out = []
    for v in batch.values():
        ts = [v] if isinstance(v, torch.Tensor) else [v.values, v.shapes]
        out += [t.untyped_storage().data_ptr() for t in ts if t.numel()]
    return out


def _epoch(
    url: str, batch: int, prefetch: int, **kw: object
) -> tuple[list[tuple[int, ...]], object]:
    with Loader(url, "cifar", batch, seed=3, rank=0, world_size=1, prefetch=prefetch, **kw) as ld:  # type: ignore[arg-type]
        ld.set_epoch(1)
        got = [ids(b) for b in ld]
        return got, ld.stats()


@pytest.mark.parametrize(("transport", "copy"), [("auto", True), ("auto", False), ("tcp", True)])
def test_grouped_batches_are_the_batches_of_one_per_message(
    server, transport: str, copy: bool
) -> None:
    """prefetch=32 (several small batches to a message) and prefetch=1 (one a message) give the same
    batches in the same order, the last short one included."""
    want, one = _epoch(server.http_url, 24, 1, transport=transport, copy=copy)
    got, stats = _epoch(server.http_url, 24, 32, transport=transport, copy=copy)
    assert one.messages == one.batches == len(want)  # type: ignore[attr-defined]
    assert got == want
    assert len(want[-1]) == N_CIFAR % 24
    assert stats.messages < stats.batches / 4, stats  # type: ignore[attr-defined]


def test_batches_cut_from_one_message_share_no_storage(server) -> None:
    """Every field of every batch has a storage of its own, only its bytes: holding or saving
    one batch's labels keeps or writes nothing of its neighbours."""
    with Loader(server.http_url, "cifar", 16, seed=0, rank=0, world_size=1, prefetch=32) as ld:
        kept = [b for _, b in zip(range(40), ld, strict=False)]
        assert ld.stats().messages < 20
    ptrs = [p for b in kept for p in _storages(b)]
    assert len(set(ptrs)) == len(ptrs), "two batches (or fields) share a storage"
    label = kept[5]["label"]
    assert label.untyped_storage().nbytes() == 16 * 8
    buf = io.BytesIO()
    torch.save(label, buf)
    assert buf.tell() < 16 * 8 + 2048
    # Kept batches are intact though the ring went round many times meanwhile.
    again = _epoch_first(server.http_url, 40)
    assert [ids(b) for b in kept] == again


def _epoch_first(url: str, n: int) -> list[tuple[int, ...]]:
    with Loader(url, "cifar", 16, seed=0, rank=0, world_size=1, prefetch=1) as ld:
        return [ids(b) for _, b in zip(range(n), ld, strict=False)]


def test_resume_in_the_middle_of_a_message(server) -> None:
    """A state taken after a batch that is not the last of its message resumes at the next one."""
    want, _ = _epoch(server.http_url, 10, 1)
    with Loader(server.http_url, "cifar", 10, seed=3, rank=0, world_size=1, prefetch=32) as ld:
        ld.set_epoch(1)
        head = [ids(b) for _, b in zip(range(7), ld, strict=False)]
        state = ld.state_dict()
    assert state["next_batch"] == 7
    with Loader(server.http_url, "cifar", 10, seed=3, rank=0, world_size=1, prefetch=32) as ld:
        ld.load_state_dict(state)
        rest = [ids(b) for b in ld]
        assert ld.stats().messages < ld.stats().batches
    assert head + rest == want


def test_variable_fields_in_grouped_messages(server) -> None:
    """Graphs (variable tensors and bytes) cut from a message equal those sent one per message."""

    def epoch(prefetch: int) -> tuple[list[dict], int]:
        with Loader(
            server.http_url, "graphs", 7, seed=2, rank=0, world_size=1, prefetch=prefetch
        ) as ld:
            out = [b for b in ld]
            return out, ld.stats().messages

    one, n_one = epoch(1)
    many, n_many = epoch(32)
    assert n_many < n_one == len(one)
    assert len(one) == len(many)
    for a, b in zip(one, many, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            x, y = a[k], b[k]
            if isinstance(x, VarTensor):
                assert [t.tolist() for t in x.unbind()] == [t.tolist() for t in y.unbind()], k
                assert int(y.offsets[0]) == 0
            else:
                assert torch.equal(x, y), k
        ptrs = _storages(b)
        assert len(set(ptrs)) == len(ptrs)


def test_pad_variable_is_one_batch_per_message(server) -> None:
    """Padding is to each batch's own longest sample, so a padding Loader never groups."""
    with Loader(
        server.http_url, "graphs", 7, seed=2, rank=0, world_size=1, prefetch=32, pad_variable=True
    ) as ld:
        n = sum(1 for _ in ld)
        assert ld.stats().messages == n


# -- the cut itself ---------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    rows=st.integers(1, 9),
)
def test_cut_rows_gives_back_every_sample_in_order(lengths: list[int], rows: int) -> None:
    total = len(lengths)
    count = -(-total // rows)
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    values = torch.arange(int(offsets[-1]), dtype=torch.float32)
    var = VarTensor(values, offsets, torch.tensor(lengths, dtype=torch.int64).reshape(-1, 1))
    fixed = torch.arange(total * 3).reshape(total, 3)
    parts = cut_rows({"v": var, "f": fixed}, rows, count)
    assert len(parts) == count
    assert [len(p["v"]) for p in parts] == [p["f"].shape[0] for p in parts]
    assert torch.equal(torch.cat([p["f"] for p in parts]), fixed)
    assert [t.tolist() for p in parts for t in p["v"].unbind()] == [
        t.tolist() for t in var.unbind()
    ]
    assert all(int(p["v"].offsets[0]) == 0 for p in parts)
    assert all(len(p["f"]) == rows for p in parts[:-1])


@pytest.mark.parametrize(
    ("total", "rows", "count"), [(10, 5, 3), (10, 3, 3), (10, 0, 2), (0, 4, 2)]
)
def test_cut_rows_refuses_rows_that_do_not_make_the_batches(
    total: int, rows: int, count: int
) -> None:
    with pytest.raises(ProtocolError, match="rows do not make"):
        cut_rows({"f": torch.zeros(total, 2)}, rows, count)


def test_graph_batches_cut_from_one_message_equal_those_sent_alone(server) -> None:
    """collate="graph": each batch of a message is collated on its own terms (batch, ptr and
    edge_index count from its own first graph and node), exactly as when sent alone."""

    def epoch(prefetch: int | None) -> tuple[list[dict], int]:
        with Loader(
            server.http_url,
            "graphs",
            9,
            seed=4,
            rank=0,
            world_size=1,
            prefetch=prefetch,
            collate="graph",
            fields=["x", "edge_index", "y"],
        ) as ld:
            return list(ld), ld.stats().messages

    one, n_one = epoch(1)
    many, n_many = epoch(None)
    assert n_many < n_one == len(one) == len(many)
    for a, b in zip(one, many, strict=True):
        assert sorted(a) == sorted(b) == ["batch", "edge_index", "ptr", "x", "y"]
        for k in a:
            assert torch.equal(a[k], b[k]), k
        assert int(b["ptr"][0]) == 0 and int(b["batch"].max()) == len(b["y"]) - 1
        ptrs = _storages(b)
        assert len(set(ptrs)) == len(ptrs), "two parts of a graph batch share a storage"


@pytest.mark.parametrize(
    "splits",
    [[[0, 2, 5], [0, 1, 3]], [[0, 3, 2], [0, 1, 2]], [[0, 2], [0, 2]], [[1, 2, 4], [0, 1, 2]]],
    ids=["past the end", "backwards", "wrong count", "not from 0"],
)
def test_graph_cuts_that_do_not_fit_are_refused(splits: list[list[int]]) -> None:
    batch = {"x": torch.zeros(4, 3), "y": torch.zeros(2), ".splits": torch.tensor(splits)}
    with pytest.raises(ProtocolError, match="splits"):
        cut_rows(batch, 1, 2)
