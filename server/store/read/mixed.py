"""A mixture's sources read as one dataset: their shard sets end to end, every batch labelled
with where each sample came from.

A mixture plan deals ids over the sources' concatenated id space (source ``k``'s sample ``i``
is id ``offsets[k] + i``, see :mod:`shardserve.server.planning.mixture`). Laying the sources'
shard sets end to end (:class:`ConcatShards`) makes that id space a dataset's own: a mixture
batch is then one ``take`` through the store's one field loop, written straight into the
stream's memory like any batch, and :class:`SourceLabels` adds the ``source`` field.

>>> mixed = mixed_dataset("mix:a+b", [store.open("a"), store.open("b")])   # doctest: +SKIP
>>> parts = mixed.take([0, 300 + 5])                                     # doctest: +SKIP
>>> parts["source"].tolist()                                             # doctest: +SKIP
[0, 1]
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from shardserve.proto.manifest import FieldSpec, Manifest
from shardserve.proto.parts import SOURCE_PART

from ...source import FRESH, BatchParts, BatchSource, PartShapes, Planned, Tail, Wrapped
from .dataset import Dataset
from .gather import JoinedColumns, RaggedChunks
from .shard_set import Chunks, ShardSet
from .stitch import StitchedColumns

__all__ = ["ConcatShards", "SourceLabels", "mixed_dataset", "mixture_manifest"]

#: A chunk list's columns of one kind: field name -> one array per chunk.
Columns = dict[str, list[np.ndarray]]
#: The ``source`` part's dtype: up to 32,767 sources (a mixture has at most 64).
SOURCE_DTYPE = "int16"


def mixed_dataset(
    label: str, sources: Sequence[Dataset], fields: Sequence[str] | None = None
) -> BatchSource:
    """The mixture of ``sources`` (each the store's shared dataset of its pinned version) as
    one source, labelled ``label`` (the job's ``mix:...`` name), serving the stored
    ``fields`` (``None``: all) and ``source``. Every source serves them as the first one does
    (the job's admission checked dtype, shape and nullability of those it reads)."""
    manifests = [ds.manifest for ds in sources]
    first = sources[0].fields
    stored = first if fields is None else tuple(f for f in first if f.name in set(fields))
    concat = ConcatShards([ds.shards for ds in sources], manifests, stored)
    joined = _joined_manifest(label, manifests).model_copy(update={"fields": stored})
    return SourceLabels(Dataset(joined, concat), concat.offsets)


def mixture_manifest(label: str, manifests: Sequence[Manifest]) -> Manifest:
    """What the mixture of datasets ``manifests`` serves (what :func:`mixed_dataset` of them
    describes): their samples end to end, the first one's fields and ``source``. For a job's
    admission, before any dataset is opened."""
    return _labelled(_joined_manifest(label, manifests))


def _joined_manifest(label: str, manifests: Sequence[Manifest]) -> Manifest:
    # Each source's shards keep their own paths; prefixed, they are distinct in one list.
    shards = tuple(
        s.model_copy(update={"path": f"{m.name}/{s.path}"}) for m in manifests for s in m.shards
    )
    # A view, never written or validated: its name is the job's label, which no stored
    # dataset may take, so nothing can mistake it for one.
    return manifests[0].model_copy(
        update={
            "name": label,
            "num_samples": sum(m.num_samples for m in manifests),
            "shards": shards,
            "source": {},
        }
    )


def _labelled(manifest: Manifest) -> Manifest:
    """``manifest`` with the :data:`SOURCE_PART` field (a view, like its input)."""
    label = FieldSpec(name=SOURCE_PART, dtype=SOURCE_DTYPE, shape=())
    return manifest.model_copy(update={"fields": (*manifest.fields, label)})


class ConcatShards:
    """The shard sets of several datasets as one (a :class:`~.shard_set.ShardSet`): source
    ``k``'s shard ``j`` is shard ``j`` plus the shards before it, its sample ``i`` is id
    ``offsets[k] + i``.

    The sources' sets are the store's, shared with other jobs: closing this closes nothing.
    Sets that hand back the same chunks every time (mapped stores) are joined once, with
    their small columns joined across sources too; others (a cache's leases) per acquire.
    """

    def __init__(
        self, sets: Sequence[ShardSet], manifests: Sequence[Manifest], fields: Sequence[FieldSpec]
    ) -> None:
        self._sets = list(sets)
        self._fields = tuple(fields)
        rows = [m.num_samples for m in manifests]
        counts = [len(m.shards) for m in manifests]
        #: First id of each source, then the total.
        self.offsets = np.zeros(len(sets) + 1, dtype=np.int64)
        np.cumsum(rows, out=self.offsets[1:])
        #: First shard of each source, then the total (a list: a batch bisects it a few times).
        self._first = [0, *itertools.accumulate(counts)]
        self._lock = threading.Lock()
        self._last: tuple[tuple[Chunks, ...], Chunks] | None = None

    @property
    def waits(self) -> bool:
        return any(s.waits for s in self._sets)

    def _split(self, shards: Iterable[int]) -> list[list[int]]:
        """Each source's own shard numbers of ``shards``."""
        per: list[list[int]] = [[] for _ in self._sets]
        first = self._first
        for s in shards:
            k = bisect.bisect_right(first, s) - 1
            per[k].append(s - first[k])
        return per

    def acquire(self, shards: Iterable[int]) -> Chunks:
        """Every source's chunks holding ``shards`` (a source with none of them still gives
        its chunks: a mapped set's are all of its shards, a cache's none)."""
        per = self._split(shards)
        got: list[Chunks] = []
        try:
            for s, mine in zip(self._sets, per, strict=True):
                got.append(s.acquire(mine))
            return self._joined(tuple(got))
        except BaseException:
            for s, mine in list(zip(self._sets, per, strict=True))[: len(got)]:
                s.release(mine)
            raise

    def _joined(self, got: tuple[Chunks, ...]) -> Chunks:
        with self._lock:
            last = self._last
        if last is not None and all(a is b for a, b in zip(last[0], got, strict=True)):
            return last[1]
        stable = all(c.joined is not None for c in got)  # a mapped set's whole chunk list
        merged = _concat(got, self.offsets, self._fields, stable)
        if stable:
            with self._lock:
                self._last = (got, merged)
        return merged

    def release(self, shards: Sequence[int]) -> None:
        for s, mine in zip(self._sets, self._split(shards), strict=True):
            s.release(mine)

    def check_reads(self, ids: np.ndarray, fields: Sequence[str]) -> None:
        """Each source checks its own samples of ``ids`` (ids within it)."""
        source = np.searchsorted(self.offsets, ids, side="right") - 1
        for k in np.unique(source).tolist():
            self._sets[k].check_reads(ids[source == k] - self.offsets[k], fields)

    def plan_hint(self, plan: Planned) -> None:
        """Each source is told its own part of the plan (ids within it, in plan order)."""
        for k, s in enumerate(self._sets):
            s.plan_hint(_SourcePart(plan, int(self.offsets[k]), int(self.offsets[k + 1])))

    def verify(self, progress: bool = False) -> None:
        for s in self._sets:
            s.verify(progress)

    def close(self) -> None:
        """Nothing: the sources' sets belong to the store."""


class _SourcePart:
    """One source's ids of a mixture plan, made on demand (a :class:`~..source.Planned`)."""

    def __init__(self, plan: Planned, lo: int, hi: int) -> None:
        self._plan, self._lo, self._hi = plan, lo, hi

    def sample_ids(self) -> np.ndarray:
        ids = np.asarray(self._plan.sample_ids(), dtype=np.int64)
        return ids[(ids >= self._lo) & (ids < self._hi)] - self._lo


def _concat(
    got: Sequence[Chunks], offsets: np.ndarray, fields: Sequence[FieldSpec], whole: bool
) -> Chunks:
    """``got`` (source ``k``'s chunks, ids within it) as one chunk list over the concatenated
    ids. ``whole``: every source gave all its chunks, so the ids run from 0 without a gap and
    small columns may be joined across them."""
    starts = [c.starts[:-1] + offsets[k] for k, c in enumerate(got)]
    ends = [int(c.starts[-1] + offsets[k]) for k, c in enumerate(got) if len(c.starts) > 1]
    names = [f.name for f in fields]
    ragged = {f.name: f.dtype for f in fields if f.kind not in ("scalar", "tensor")}
    stitched = [c.stitched for c in got if c.stitched is not None] if whole else []

    def joined(pick: Callable[[Chunks], Mapping[str, list[np.ndarray]]]) -> Columns:
        """The fields of ``names`` that ``pick`` holds, every source's chunks in order."""
        out: Columns = {}
        for n in names:
            lists = [pick(c).get(n) for c in got]
            if all(x is not None for x in lists):
                out[n] = [a for x in lists if x is not None for a in x]
        return out

    return Chunks(
        starts=np.concatenate([*starts, np.asarray(ends[-1:] or [0], dtype=np.int64)]),
        fixed=joined(lambda c: c.fixed),
        valid=joined(lambda c: c.valid),
        shapes=joined(lambda c: c.shapes),
        arrays={
            n: RaggedChunks([a for c in got for a in c.arrays[n]], dtype)
            for n, dtype in ragged.items()
        },
        joined=JoinedColumns() if whole else None,
        stitched=StitchedColumns.joining(stitched) if len(stitched) == len(got) else None,
    )


class SourceLabels(Wrapped):
    """A mixture's samples with one field more, :data:`SOURCE_PART`: the index (int16) of
    each sample's source, from its id and the sources' ``offsets``. Served like any field:
    with every field, or when ``fields`` names it (a loop that does not read it saves its
    per-batch cost)."""

    def __init__(self, inner: BatchSource, offsets: np.ndarray) -> None:
        super().__init__(inner)
        self._offsets = offsets
        self._manifest = _labelled(inner.manifest)

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    def replaceable_by(self, index: int) -> tuple[int, int]:
        """Its own source's ids: a replacement keeps the source (and its weight) it stands in
        for."""
        k = int(np.searchsorted(self._offsets, index, "right")) - 1
        return int(self._offsets[k]), int(self._offsets[k + 1])

    def field_names(self, fields: Sequence[str] | None = None) -> list[str]:
        stored, label = _stored(fields)
        return [*self.inner.field_names(stored), *([SOURCE_PART] if label else [])]

    def part_shapes(self, fields: Sequence[str] | None = None) -> PartShapes:
        stored, label = _stored(fields)
        shapes = dict(self.inner.part_shapes(stored))
        if label:
            shapes[SOURCE_PART] = (SOURCE_DTYPE, ())
        return shapes

    def take(
        self,
        indices: np.ndarray | Sequence[int],
        fields: Sequence[str] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        batch: int = -1,
        tail: Tail = FRESH,
    ) -> BatchParts:
        stored, label = _stored(fields)
        parts = self.inner.take(indices, stored, out, batch, tail)
        if not label:
            return parts
        ids = np.asarray(indices, dtype=np.int64)
        dest = out.get(SOURCE_PART) if out is not None else None
        if dest is None or dest.shape != ids.shape or dest.dtype != np.dtype(SOURCE_DTYPE):
            dest = np.empty(ids.shape, dtype=SOURCE_DTYPE)
        # ``right``: a source with no samples shares its offset with the next one.
        np.subtract(np.searchsorted(self._offsets, ids, "right"), 1, out=dest, casting="unsafe")
        parts[SOURCE_PART] = dest
        return parts


def _stored(fields: Sequence[str] | None) -> tuple[list[str] | None, bool]:
    """``fields`` without :data:`SOURCE_PART` (``None``: all), and whether it was asked for."""
    if fields is None:
        return None, True
    names = list(fields)
    return [n for n in names if n != SOURCE_PART], SOURCE_PART in names
