"""The client checks what it is sent: a real server behind a relay that lies (see
tests/support/lying.py) gets a ``ProtocolError`` naming the field, never wrong data."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardserve.client import Loader, ProtocolError
from shardserve.proto.messages import BatchHeader
from tests.client.conftest import N_CIFAR, ids
from tests.support.lying import lying
from tests.support.slowness import scaled


def _relabel_count(header: BatchHeader, payload: list[bytes]) -> tuple[BatchHeader, list[bytes]]:
    """A message of several batches relabelled as one (``count=1``)."""
    if header.count > 1:
        header = dataclasses.replace(header, count=1)
    return header, payload


def test_a_message_relabelled_count_1_is_refused(server) -> None:
    """A message of several small batches whose header says ``count=1`` is refused naming
    ``count``; every batch handed out before it holds exactly 8 distinct planned samples."""
    with lying(server) as relay:
        relay.batch_lie = _relabel_count
        with Loader(
            relay.http_url,
            "cifar",
            8,
            seed=3,
            rank=0,
            world_size=1,
            transport="socket",
            timeout=scaled(30),
        ) as ld:
            got: list[tuple[int, ...]] = []
            with pytest.raises(ProtocolError, match=r"count=1 batches of rows=8") as e:
                for b in ld:
                    got.append(ids(b))
        assert relay.lies >= 1
    assert "part 'image' holds" in str(e.value) or "part 'label' holds" in str(e.value)
    assert all(len(b) == 8 for b in got)
    flat = [i for b in got for i in b]
    assert len(flat) == len(set(flat)) and all(0 <= i < N_CIFAR for i in flat)


def _lie_offsets(field: str, how: str):
    def lie(header: BatchHeader, payload: list[bytes]) -> tuple[BatchHeader, list[bytes]]:
        names = [p.name for p in header.parts]
        k = names.index(f"{field}.offsets")
        o = np.frombuffer(payload[k], dtype=np.int64).copy()
        if how == "fall" and len(o) > 2:
            o[1], o[2] = o[2], o[1]  # a sample that ends before it starts
        elif how == "end":
            o[-1] += 3  # past the values that travel
        return header, [*payload[:k], o.tobytes(), *payload[k + 1 :]]

    return lie


@pytest.mark.parametrize(
    ("field", "how", "match"),
    [
        ("x", "fall", r"part 'x\.offsets'.*fall after sample 1"),
        ("smiles", "end", r"part 'smiles\.offsets'.*rise from 0 to"),
        ("x", "end", r"part 'x\.offsets'.*rise from 0 to"),
    ],
)
def test_offsets_that_lie_are_refused(server, field: str, how: str, match: str) -> None:
    """``.offsets`` that fall, or end past the values sent, are a ProtocolError naming the
    part, before any batch of that message is handed out."""
    with lying(server) as relay:
        relay.batch_lie = _lie_offsets(field, how)
        with Loader(
            relay.http_url,
            "graphs",
            4,
            seed=1,
            rank=0,
            world_size=1,
            transport="socket",
            timeout=scaled(30),
        ) as ld:
            it = iter(ld)
            with pytest.raises(ProtocolError, match=match):
                next(it)


def _ids_of(body: bytes) -> np.ndarray:
    return np.frombuffer(body, dtype="<i8").copy()


def test_a_resident_id_out_of_range_is_refused(server) -> None:
    """A resident plan naming a sample past the data is a ProtocolError naming the id and
    the range, before any index_select (on CUDA: a device-side assert)."""
    with lying(server) as relay:

        def lie(body: bytes) -> bytes:
            a = _ids_of(body)
            a[37] = N_CIFAR + 7
            return a.tobytes()

        relay.plan_lie = lie
        out_of_range = rf"id {N_CIFAR + 7} \(batch 1\) is out of range 0 <= id < {N_CIFAR}"
        with (
            Loader(
                relay.http_url,
                "cifar",
                32,
                resident="cpu",
                rank=0,
                world_size=1,
                transport="socket",
                timeout=scaled(30),
            ) as ld,
            pytest.raises(ProtocolError, match=out_of_range),
        ):
            next(iter(ld))


def test_a_resident_plan_8_ids_short_is_refused(server) -> None:
    """A resident plan 8 ids short (the same number of batches) is a ProtocolError naming the
    lengths, not a short last batch."""
    with lying(server) as relay:
        relay.plan_lie = lambda body: body[: -8 * 8]
        with (
            Loader(
                relay.http_url,
                "cifar",
                32,
                resident="cpu",
                rank=1,
                world_size=2,
                transport="socket",
                timeout=scaled(30),
            ) as ld,
            pytest.raises(ProtocolError, match=r"492 ids in 16 batches .* plans 500 ids"),
        ):
            next(iter(ld))


def test_an_honest_relay_changes_nothing(server) -> None:
    """The relay itself is transparent: through it the Loader gets the planned epoch."""
    with (
        lying(server) as relay,
        Loader(
            relay.http_url,
            "cifar",
            8,
            seed=3,
            rank=0,
            world_size=1,
            transport="socket",
            timeout=scaled(30),
        ) as ld,
    ):
        got = [i for b in ld for i in ids(b)]
    assert sorted(got) == list(range(N_CIFAR))
