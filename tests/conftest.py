"""Suite-wide checks: what the tests leave behind on the machine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

SHM = Path("/dev/shm")


def _segments() -> set[str]:
    return {p.name for p in SHM.glob("shardserve-*")} if SHM.is_dir() else set()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind() -> Iterator[None]:
    """Every slot ring a test's server made is unlinked by the end of the suite."""
    before = _segments()
    yield
    left = _segments() - before
    assert not left, f"shared-memory segments left behind by the suite: {sorted(left)}"
