"""One storage per field in delivered batches, over every transport, against a real server:
fields never share a storage, one saved field writes only itself, and a field kept after
its batch's other fields are gone still holds its slot (its bytes are not overwritten)."""

from __future__ import annotations

import io

import pytest
import torch

from shardserve.client import Loader
from tests.client.conftest import ids


def _storages(batch: dict) -> list[int]:
    out = []
    for v in batch.values():
        ts = [v] if isinstance(v, torch.Tensor) else [v.values, v.offsets, v.shapes]
        out += [t.untyped_storage().data_ptr() for t in ts]
    return out


@pytest.mark.parametrize(("transport", "copy"), [("auto", True), ("auto", False), ("tcp", True)])
def test_every_field_has_a_storage_of_its_own(server, transport: str, copy: bool) -> None:
    with Loader(
        server.http_url, "cifar", 64, seed=1, rank=0, world_size=1, transport=transport, copy=copy
    ) as ld:
        for batch in ld:
            ptrs = _storages(batch)
            assert len(set(ptrs)) == len(ptrs), "two fields of one batch share a storage"
            label = batch["label"]
            assert label.untyped_storage().nbytes() == label.numel() * 8
            buf = io.BytesIO()
            torch.save(label, buf)
            assert buf.tell() < label.numel() * 8 + 2048, (
                f"saving {label.numel()} labels wrote {buf.tell()} bytes"
            )
            break


def test_variable_fields_have_storages_of_their_own(server) -> None:
    with Loader(server.http_url, "graphs", 16, seed=0, rank=0, world_size=1) as ld:
        batch = next(iter(ld))
    ptrs = _storages(batch)
    assert len(set(ptrs)) == len(ptrs)


def test_a_kept_field_keeps_its_slot(server) -> None:
    """Labels kept from every batch (images dropped) stay intact while the ring is reused many times."""
    with Loader(server.http_url, "cifar", 40, seed=4, rank=0, world_size=1, prefetch=2) as ld:
        kept, want = [], []
        for batch in ld:
            want.append(ids(batch))
            kept.append(batch["label"])
        stats = ld.stats()
    assert len(kept) > 4 * 2  # many times the ring's slots
    assert [tuple(int(i) % 10 for i in w) for w in want] == [tuple(k.tolist()) for k in kept]
    assert stats.batches == len(kept)
