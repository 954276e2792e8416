"""Suite-wide checks: what the tests leave behind on the machine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

SHM = Path("/dev/shm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` need a GPU: skipped, with the reason, where torch sees none."""
    gpu_tests = [item for item in items if item.get_closest_marker("cuda")]
    if not gpu_tests:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_tests:
        item.add_marker(skip)


def _segments() -> set[str]:
    return {p.name for p in SHM.glob("shardserve-*")} if SHM.is_dir() else set()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind() -> Iterator[None]:
    """Every slot ring a test's server made is unlinked by the end of the suite."""
    before = _segments()
    yield
    left = _segments() - before
    assert not left, f"shared-memory segments left behind by the suite: {sorted(left)}"
