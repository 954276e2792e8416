"""Fixtures for framework tests: one real store and one real server per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, run_server

N_SAMPLES = 1000
#: An evaluation set that 2 ranks cannot split evenly (the plan pads one sample).
N_EVAL = 1001


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    make_cifar_like(root, "cifar", n=N_SAMPLES)
    make_cifar_like(root, "eval", n=N_EVAL)
    return root


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProc]:
    with run_server(store) as srv:
        yield srv
