"""Helpers for format tests: read a whole dataset back through a Loader, split batches into
samples, and compare them with the source samples."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from shardserve.client import Loader, VarTensor
from shardserve.client.structure import Masked, Texts
from tests.support.slowness import scaled


def split(batch: Any, n: int) -> list[Any]:
    """A collated batch (nested dicts / tuples of tensors, VarTensor, Masked) as ``n`` samples."""
    if isinstance(batch, Texts):
        assert len(batch) == n, batch
        return list(batch)
    if isinstance(batch, Mapping):
        cols = {k: split(v, n) for k, v in batch.items()}
        return [{k: c[i] for k, c in cols.items()} for i in range(n)]
    if isinstance(batch, (tuple, list)):
        cols2 = [split(v, n) for v in batch]
        return [type(batch)(c[i] for c in cols2) for i in range(n)]
    if isinstance(batch, (Masked, VarTensor)):
        return batch.unbind()
    if batch is None:
        return [None] * n
    assert isinstance(batch, torch.Tensor) and batch.shape[0] == n, batch
    return list(batch)


def read_all(url: str, name: str, batch_size: int = 7, **kw: Any) -> list[Any]:
    """Every sample of ``name`` in store order, through a real Loader."""
    out: list[Any] = []
    with Loader(url, name, batch_size, shuffle=False, timeout=scaled(30), **kw) as loader:
        for batch in loader:
            size = _size(batch)
            out.extend(split(batch, size))
    return out


def _size(batch: Any) -> int:
    if isinstance(batch, Texts):  # a list, but one item per sample
        return len(batch)
    if isinstance(batch, Mapping):
        return _size(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)):
        return _size(batch[0])
    if isinstance(batch, (Masked, VarTensor, Texts)):
        return len(batch)
    return int(batch.shape[0])


def _none_like(x: Any) -> bool:
    """None, or a dict / tuple of nothing but None (how a missing subtree reads back)."""
    if x is None:
        return True
    if isinstance(x, Mapping):
        return all(_none_like(v) for v in x.values())
    if isinstance(x, (tuple, list)):
        return all(_none_like(v) for v in x)
    return False


def assert_same(got: Any, want: Any, where: str = "sample") -> None:
    """``got`` (from the Loader) holds exactly ``want`` (the source sample)."""
    if want is None:
        assert _none_like(got), f"{where}: expected None, got {got!r}"
        return
    if isinstance(want, Mapping):
        assert isinstance(got, Mapping), f"{where}: expected a dict, got {type(got).__name__}"
        assert [str(k) for k in want] == list(got), f"{where}: keys {list(got)} != {list(want)}"
        for k, v in want.items():
            assert_same(got[str(k)], v, f"{where}.{k}")
        return
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), f"{where}: {got!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
        return
    assert got is not None, f"{where}: expected {want!r}, got None (masked)"
    if isinstance(got, (str, list)):  # a text field: str, or a list of str
        assert got == want, f"{where}: {got!r} != {want!r}"
        return
    w = want.numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    g = got.numpy()
    if isinstance(want, (bytes, str)):
        b = want.encode() if isinstance(want, str) else want
        assert g.tobytes() == b, f"{where}: bytes differ"
        return
    assert g.shape == w.shape, f"{where}: shape {g.shape} != {w.shape}"
    assert g.dtype == w.dtype, f"{where}: dtype {g.dtype} != {w.dtype}"
    assert np.array_equal(g, w), f"{where}: values differ"
