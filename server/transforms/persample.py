"""Batch kernels that still work sample by sample (decoding, resampling images of different
sizes): failures are told per sample, as a sample transform's are, so ``on_error="replace"``
swaps exactly the samples that failed."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from .errors import StepFailed

T = TypeVar("T")


def each_sample(transform: str, ids: np.ndarray, fn: Callable[[int], T]) -> list[T]:
    """``[fn(0), ..., fn(len(ids) - 1)]``; if any raise, one :class:`StepFailed` naming the
    first failing sample and listing all of them (``ids``: the samples' global indices).

    >>> each_sample("t", np.array([7, 8]), lambda i: i * 2)
    [0, 2]
    """
    out: list[T] = []
    failed: StepFailed | None = None
    for i in range(len(ids)):
        try:
            got = fn(i)
        except Exception as e:
            if failed is None:
                failed = StepFailed(transform, i, int(ids[i]), f"{type(e).__name__}: {e}")
            else:
                failed.all.append((i, int(ids[i])))
            continue
        out.append(got)
    if failed is not None:
        raise failed
    return out


def refuse_samples(transform: str, ids: np.ndarray, bad: np.ndarray, text: str) -> None:
    """Raise :class:`StepFailed` for the samples at positions ``bad`` (none: return)."""
    if len(bad) == 0:
        return
    failed = StepFailed(transform, int(bad[0]), int(ids[bad[0]]), text)
    failed.all += [(int(i), int(ids[i])) for i in bad[1:]]
    raise failed
