"""The ring layout both sides share: slots, parts and names as proto/rings.py defines them."""

from __future__ import annotations

import pytest

from shardserve.proto.rings import (
    ALIGN,
    SlotOutOfRange,
    align,
    part_fits,
    plain_name,
    ring_name,
    slot_start,
)


def test_a_slot_outside_the_ring_is_refused_as_the_server_and_the_client_each_catch_it() -> None:
    """A slot number outside the ring names itself and the range, and is both an IndexError and a ValueError."""
    assert slot_start(3, 4, 1024) == 3072
    for bad in (-1, 4):
        with pytest.raises(IndexError, match=rf"slot {bad} out of range 0 <= slot < 4"):
            slot_start(bad, 4, 1024)
        with pytest.raises(ValueError, match=rf"slot {bad} out of range"):
            slot_start(bad, 4, 1024)
    assert issubclass(SlotOutOfRange, IndexError) and issubclass(SlotOutOfRange, ValueError)


def test_parts_names_and_alignment_follow_the_layout() -> None:
    """Parts must end inside their slot, names the server makes are plain and others are not, and sizes round up to a cache line."""
    assert part_fits(0, 1024, 1024) and not part_fits(1, 1024, 1024)
    assert plain_name(ring_name(12, 3, "00ff00ff"))
    assert ring_name(12, 3, "00ff00ff") == "shardserve-12-3-00ff00ff"
    assert not plain_name("../x") and not plain_name(".shardserve-12-3-00ff00ff")
    assert [align(n) for n in (0, 1, ALIGN, ALIGN + 1)] == [0, ALIGN, ALIGN, 2 * ALIGN]
