"""Suite-wide checks: what the tests leave behind on the machine."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SHM = Path("/dev/shm")
#: A slot ring's name starts with its server's pid (server/runtime/rings.py).
_OWNER = re.compile(r"^shardserve-(\d+)-")
#: Pids of the processes this test session started (servers among them).
_CHILDREN: set[int] = set()


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


def _ours(name: str) -> bool:
    m = _OWNER.match(name)
    return m is not None and int(m.group(1)) in _CHILDREN


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind() -> Iterator[None]:
    """Every slot ring a server of this session made is unlinked by the end of the suite.

    Only this session's servers count: other processes on the machine (another test run, a
    real server) own their segments. A server is ours when this process started it: every
    ``subprocess.Popen`` of the session records its child's pid.
    """
    original = subprocess.Popen.__init__

    def recording_init(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _CHILDREN.add(self.pid)

    subprocess.Popen.__init__ = recording_init  # type: ignore[method-assign]
    before = _segments()
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original  # type: ignore[method-assign]
    left = sorted(n for n in _segments() - before if _ours(n))
    assert not left, f"shared-memory segments left behind by the suite's servers: {left}"
