"""What a batch is read from: the contract every source and every decorator of one meets.

A job's batches come from a chain built in one place (:func:`~.sources.open_source`), each
link wrapping the one above it::

    what the job reads as stored, from its kind (``JobKind.open_stored``):
      Dataset   one dataset's shards, mapped locally or leased from a remote store's cache
      SourceLabels over a Dataset of ConcatShards   a mixture: its sources end to end
      └─ TransformedDataset   the job's transform chain, bound to one stream (each sample)
           └─ GraphCollated   collate="graph": the transformed graphs put together for
                              message passing

Streaming and assembly see only :class:`BatchSource`: they never ask which link they hold.
A new kind of source implements the protocol; a new decorator subclasses :class:`Wrapped`,
which passes every question on to the source it wraps, and overrides what it changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shardserve.proto.manifest import Manifest

#: A batch as a source returns it: part name -> array, in frame order.
BatchParts = dict[str, np.ndarray]
#: Part name -> ``(dtype, per-sample shape)`` for fixed-size parts, ``None`` for variable ones.
PartShapes = Mapping[str, "tuple[str, tuple[int, ...]] | None"]
#: ``pick(lengths) -> rows``: given each sample's first-dimension length (int64 ``[B]``),
#: which of its rows to read (int64 ``[B, k]``, each below its sample's length).
RowPick = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True, slots=True)
class FileSpan:
    """Bytes ``offset`` to ``offset + nbytes`` of the shared file at ``path``."""

    path: str
    offset: int
    nbytes: int


class Spans(Protocol):
    """Where a batch is sent from says where an array lies in it: by shared file and offset,
    so work in another process (a transform worker) writes outputs straight there instead
    of sending them back through a pipe to be copied. Pointers never leave the process.

    >>> FRESH.span_of(np.zeros(4)) is None
    True
    """

    def span_of(self, arr: np.ndarray) -> FileSpan | None:
        """Where C-contiguous ``arr`` lies in a shared file, or ``None`` when it does not
        lie in this batch's shared memory (or is empty or not contiguous)."""
        ...


class Tail(Spans, Protocol):
    """Memory for the variable-size parts a ``take`` makes, where its batch is sent from (a
    shared-memory slot's tail): written there, they are not copied there afterwards. A
    2 MB batch of graphs spent a third of its assembly on that copy.

    >>> FRESH.empty("x", (2, 3), np.dtype("int64")).shape
    (2, 3)
    """

    def empty(self, part: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised C-contiguous array for part ``part``: in the tail while it has
        room, else in fresh memory (the batch is then copied or sent as it is)."""
        ...


class _Fresh:
    def empty(self, part: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def span_of(self, arr: np.ndarray) -> FileSpan | None:
        return None  # fresh memory is no shared file


#: The tail of a batch that is sent from wherever its parts are (a socket, a share group).
FRESH: Tail = _Fresh()


class Placer(Tail, Protocol):
    """Where one batch is sent from (a shared-memory slot): ``take`` makes its variable-size
    parts there (:class:`Tail`), then the placer moves the parts still elsewhere in."""

    def __call__(self, parts: BatchParts) -> BatchParts:
        """``parts``, each where the batch is sent from if they all fit, else unchanged."""
        ...


class Planned(Protocol):
    """A stream's plan as a source that reads ahead sees it (``RankPlan``, ``EnvSteps``)."""

    def sample_ids(self) -> np.ndarray:
        """Every sample id the stream reads, in order (made on demand: it may cost a copy)."""
        ...


class StreamPlan(Planned, Protocol):
    """A rank's batches of an epoch as its stream reads them (``RankPlan``, ``EnvSteps``, a
    mixture's plan that follows its schedule)."""

    def __len__(self) -> int:
        """Batches in the epoch."""
        ...

    def batch(self, i: int) -> np.ndarray:
        """The sample ids of batch ``i``, read when the stream assembles it."""
        ...

    def span(self, i: int, count: int) -> np.ndarray:
        """The ids of batches ``i`` to ``i + count - 1`` in order (one message's), read when
        the stream assembles them."""
        ...

    def ready(self, i: int, count: int) -> bool:
        """Whether :meth:`span` of ``i, count`` can be read now without planning (never
        blocks): ``False`` while a re-plan it needs runs on the planning lane, which wakes
        the streamer when it lands; raises ``TimeoutError`` naming the re-plan once it was
        waited for too long."""
        ...


class BatchSource(Protocol):
    """A dataset as streaming reads it (thread-safe: ``take`` runs on assembly workers)."""

    @property
    def manifest(self) -> Manifest:
        """What the source serves: its fields are the fields ``take`` returns."""
        ...

    @property
    def shard_rows(self) -> np.ndarray:
        """Samples per stored shard (plans of a ``block`` shuffle follow them)."""
        ...

    @property
    def sample_bytes(self) -> float:
        """Bytes of one sample as served (variable-size fields at the dataset's average):
        what a batch's memory is sized by before its first take."""
        ...

    @property
    def groupable(self) -> bool:
        """Whether several batches may travel in one message: not when a step draws its
        numbers per batch, which would change what it sees."""
        ...

    @property
    def lane(self) -> str | None:
        """The job whose own threads assemble these batches (one that waits on a hung
        transform then holds only that job's threads); ``None``: the shared pool."""
        ...

    @property
    def inline_ok(self) -> bool:
        """Whether a take is cheap and never waits (on a fetch, a transform's deadline), so
        that a lone stream's small batches may be assembled on the streamer thread."""
        ...

    def field_names(self, fields: Sequence[str] | None = None) -> list[str]:
        """``fields`` checked against the manifest (``None``: every field), or ``KeyError``
        / ``BadRequest`` naming the unknown ones."""
        ...

    def part_shapes(self, fields: Sequence[str] | None = None) -> PartShapes:
        """The batch parts of ``fields``, laid out before the first batch."""
        ...

    def plan_hint(self, plan: Planned) -> None:
        """The plan a stream will read: a source that fetches reads ahead (and only such a
        source asks the plan for its ids)."""
        ...

    def replaceable_by(self, index: int) -> tuple[int, int]:
        """The ids ``[lo, hi)`` a sample served instead of sample ``index`` is drawn from
        (``on_error="replace"``): the dataset's, or a mixture's source's."""
        ...

    def take(
        self,
        indices: np.ndarray | Sequence[int],
        fields: Sequence[str] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        batch: int = -1,
        tail: Tail = FRESH,
    ) -> BatchParts:
        """Samples ``indices`` as batch parts; fixed-size parts written into ``out`` when
        given, variable-size ones made in ``tail``. ``batch``: the batch's index in its
        stream (transforms draw from it)."""
        ...

    def take_rows(
        self, indices: np.ndarray, field: str, pick: RowPick, out: np.ndarray
    ) -> np.ndarray:
        """Rows ``pick(lengths)`` of the stored variable field ``field`` (shape ``[-1,
        fixed...]``) of samples ``indices``, gathered into ``out`` (``[B, k, fixed...]``)
        straight from the store: the samples' other rows are never read. Returns ``out``;
        ``ValueError`` for a field whose rows cannot be read so (bit-packed bools)."""
        ...


class Wrapped:
    """A decorator of a source: every question goes on to ``inner``, stated one by one so
    that a subclass shows what it changes by what it overrides."""

    def __init__(self, inner: BatchSource) -> None:
        self.inner = inner

    @property
    def manifest(self) -> Manifest:
        return self.inner.manifest

    @property
    def shard_rows(self) -> np.ndarray:
        return self.inner.shard_rows

    @property
    def sample_bytes(self) -> float:
        return self.inner.sample_bytes

    @property
    def groupable(self) -> bool:
        return self.inner.groupable

    @property
    def lane(self) -> str | None:
        return self.inner.lane

    @property
    def inline_ok(self) -> bool:
        return self.inner.inline_ok

    def field_names(self, fields: Sequence[str] | None = None) -> list[str]:
        return self.inner.field_names(fields)

    def part_shapes(self, fields: Sequence[str] | None = None) -> PartShapes:
        return self.inner.part_shapes(fields)

    def plan_hint(self, plan: Planned) -> None:
        self.inner.plan_hint(plan)

    def replaceable_by(self, index: int) -> tuple[int, int]:
        return self.inner.replaceable_by(index)

    def take(
        self,
        indices: np.ndarray | Sequence[int],
        fields: Sequence[str] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        batch: int = -1,
        tail: Tail = FRESH,
    ) -> BatchParts:
        return self.inner.take(indices, fields, out, batch, tail)

    def take_rows(
        self, indices: np.ndarray, field: str, pick: RowPick, out: np.ndarray
    ) -> np.ndarray:
        return self.inner.take_rows(indices, field, pick, out)
