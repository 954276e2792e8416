"""A chain that only chooses rows reads only the rows it chooses: ``random_subset`` of a
stored variable field (UPT's query points: 512 of 1,000-5,000 points a cloud), alone in its
job's chain, is pushed down into the read.

Run as a transform, the step gets each sample's whole cloud, copied out of the shard, then
takes its rows: every point is read and copied once to be dropped (a batch of 16 clouds:
~576 KB moved for ~100 KB kept). Pushed down, the source reads each sample's length from the
field's stored offsets (no value read), the step's draws pick the rows from those lengths,
and the source gathers just those rows from the mapped shard straight into the stream's
memory (:meth:`~..source.BatchSource.take_rows`). The draws are the step's own
(:func:`~.rows.subset_rows` from :func:`~.runner.step_keys`, the same keys and the same
function as the batch kernel), so the bytes are those of the step run as a transform, in
any batch, rank or pool.

It runs where the batch is read (on the job's assembly thread, whatever ``--transform-pool``
says): it is a gather with no user code, bounded by the batch's size, that needs no worker.
A chain with more steps runs as a chain: a worker process compiles a chain from its steps'
names, so a step's position (its keys) is kept only when the whole chain travels.

>>> pushdown_of(Chain((), {}, {})) is None
True
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from ..source import BatchParts, BatchSource, RowPick, Tail
from .errors import StepFailed
from .keys import SampleKeys
from .metrics import TransformMetrics
from .rows import RandomSubset, random_subset, subset_rows
from .runner import Where, join_parts, split_parts, step_keys
from .spec import Chain


@dataclass(frozen=True)
class Pushdown:
    """A chain of one ``random_subset`` of a stored variable field, read as a gather."""

    chain: Chain
    params: RandomSubset
    #: The step's position in the job's chain: its keys come from it.
    step: int

    def run(
        self,
        source: BatchSource,
        indices: np.ndarray,
        where: Where,
        names: Sequence[str],
        out: Mapping[str, np.ndarray] | None,
        into: Mapping[str, np.ndarray],
        tail: Tail,
        metrics: TransformMetrics,
    ) -> BatchParts:
        """The chain's outputs ``names`` of samples ``indices`` of batch ``where``, as
        :func:`~.runner.run_chain` gives them from the stored parts (fixed ones written into
        ``out``; ``into``: where the fields served as stored are gathered). Raises
        :class:`StepFailed` as the step would (a sample with fewer rows than ``n``)."""
        t0 = time.perf_counter()
        field, b = self.params.field, indices.size
        others = [n for n in self.chain.inputs if n != field]
        parts = dict(source.take(indices, others, out=into, batch=where.batch)) if others else {}
        dest = self._dest(names, out, b)
        keys = step_keys(where, self.step, indices)
        parts[field] = source.take_rows(indices, field, self._pick(keys), dest)
        result = join_parts(
            split_parts(parts, self.chain.outputs), self.chain.outputs, names, out, tail
        )
        metrics.ran({random_subset.name: time.perf_counter() - t0}, b)
        return result

    def _pick(self, keys: SampleKeys) -> RowPick:
        """The step's draw of rows from the samples' lengths; its errors are the step's."""

        def pick(lengths: np.ndarray) -> np.ndarray:
            try:
                return subset_rows(self.params, keys, lengths)
            except StepFailed:  # samples with fewer rows than n, named
                raise
            except Exception as e:
                raise StepFailed(random_subset.name, None, None, f"{type(e).__name__}: {e}") from e

        return pick

    def _dest(
        self, names: Sequence[str], out: Mapping[str, np.ndarray] | None, b: int
    ) -> np.ndarray:
        """Where the rows go: the stream's array of the field when it is served and has
        exactly its shape, dtype and a contiguous layout, else fresh memory."""
        f = self.chain.outputs[self.params.field]
        shape, dt = (b, *f.shape), np.dtype(f.dtype)
        a = out.get(self.params.field) if out is not None else None
        if a is None or self.params.field not in names:
            return np.empty(shape, dt)
        return (
            a
            if a.shape == shape and a.dtype == dt and a.flags.c_contiguous
            else np.empty(shape, dt)
        )


def pushdown_of(chain: Chain) -> Pushdown | None:
    """The chain as a :class:`Pushdown` when it is one ``random_subset`` of a variable
    field ``[-1, fixed...]`` of numbers (not bit-packed bools), else ``None``."""
    if len(chain.steps) != 1 or chain.steps[0].transform is not random_subset:
        return None
    step = chain.steps[0]
    p = cast(RandomSubset, step.params)  # the step is random_subset: these are its params
    f = chain.inputs.get(p.field)
    if f is None or f.fixed or f.binary or f.dtype == "bool" or f.shape[:1] != (-1,):
        return None
    return Pushdown(chain, p, step.origin[0] if step.origin else 0)
