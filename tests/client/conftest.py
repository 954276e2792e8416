"""Fixtures for client tests: one real store and one real server per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.data import make_cifar_like, make_graph_like, sample_id_of
from tests.support.server import ServerProc, run_server

N_CIFAR = 1000


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    make_cifar_like(root, "cifar", n=N_CIFAR)
    make_graph_like(root, "graphs", n=120)
    return root


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProc]:
    with run_server(store) as srv:
        yield srv


def ids(batch: dict) -> tuple[int, ...]:
    """The sample ids of a cifar-like batch (labels checked against them)."""
    return tuple(
        int(i)
        for i in sample_id_of({"image": batch["image"].numpy(), "label": batch["label"].numpy()})
    )
