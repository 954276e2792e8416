"""Query sampling: random rows of a field with a variable first dimension (the points of a
cloud), a batch kernel drawing each sample's rows from its own keys."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from pydantic import Field

from .draws import subset_indices
from .keys import SampleKeys
from .params import FieldParams
from .persample import refuse_samples
from .registry import Columns, batch_transform
from .schema import Field as F
from .schema import Schema


class RandomSubset(FieldParams):
    n: int = Field(ge=1, le=1 << 24)
    #: Draw with replacement (a sample with fewer than ``n`` rows then still works).
    replace: bool = False


def _subset_outputs(p: RandomSubset, inputs: Schema) -> dict[str, F]:
    """{field: same dtype, [n, rest...]}"""
    if p.field not in inputs:
        raise ValueError(f"no field {p.field!r}")
    f = inputs[p.field]
    if f.binary or not f.shape or -1 in f.shape[1:]:
        raise ValueError(
            f"field {p.field!r} is {f.describe()}; rows need shape [-1 or N, fixed...]"
        )
    return {p.field: F(f.dtype, (p.n, *f.shape[1:]))}


@batch_transform(params=RandomSubset, outputs=_subset_outputs, takes_keys=True, takes_out=True)
def random_subset(
    batch: Columns,
    p: RandomSubset,
    rng: np.random.Generator | None,
    keys: SampleKeys,
    out: Mapping[str, np.ndarray],
) -> Columns:
    """``n`` random rows of a field with a variable first dimension (query points of a
    latent): without ``replace`` in ascending order, with it in draw order. The rows of the
    whole batch are drawn at once (:func:`~.draws.subset_indices`), then gathered straight
    into the batch's memory."""
    xs = batch[p.field]
    sizes = np.fromiter((x.shape[0] for x in xs), np.int64, count=len(xs))
    rows = subset_rows(p, keys, sizes)
    dest = out.get(p.field)
    if dest is None:
        first = np.asarray(xs[0]) if len(xs) else np.empty((0,), np.float32)
        dest = np.empty((len(xs), p.n, *first.shape[1:]), first.dtype)
    for i, x in enumerate(xs):
        np.take(x, rows[i], axis=0, out=dest[i])  # 2-3x faster than x[rows] on rows of floats
    return {p.field: dest}


def subset_rows(p: RandomSubset, keys: SampleKeys, sizes: np.ndarray) -> np.ndarray:
    """``int64[B, n]``: the rows :func:`random_subset` takes of samples with ``sizes[i]``
    rows, from their keys alone. A reader that knows the sizes before reading the values (a
    variable field's offsets) gathers only these rows (:mod:`.pushdown`): the same bytes.

    >>> k = SampleKeys(seed=0, epoch=0, step=0, ids=np.arange(2))
    >>> subset_rows(RandomSubset(field="x", n=2), k, np.array([5, 9])).shape
    (2, 2)
    """
    if not p.replace:
        refuse_samples(
            "random_subset",
            keys.ids,
            np.flatnonzero(sizes < p.n),
            f"field {p.field!r} has fewer rows than n={p.n}; pass replace=true to draw with "
            "replacement",
        )
    return subset_indices(keys, sizes, p.n, p.replace)
