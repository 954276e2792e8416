"""Fixtures for server tests: a real store on disk and a real server subprocess on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, run_server

CIFAR_N = 1000


@pytest.fixture(scope="session")
def cifar_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding ``cifar`` (1000 cifar-like samples in ~1 MiB shards); read-only for tests."""
    root = tmp_path_factory.mktemp("store")
    make_cifar_like(root, "cifar", n=CIFAR_N, seed=0)
    return root


@pytest.fixture(scope="module")
def server(cifar_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server per test module on the shared store (its journal in a private state dir)."""
    state = tmp_path_factory.mktemp("state")
    with run_server(cifar_store, "--state-dir", str(state)) as srv:
        yield srv
