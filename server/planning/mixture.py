"""The epoch order of a mixture job: several sources, weighted per position, steerable.

A mixture epoch is one canonical global order of ``length`` positions over the *concatenated
id space* (source ``s``'s sample ``i`` is ``offsets[s] + i``), dealt to ranks like any epoch
order (:meth:`~.partition.RankPlan.from_order`), so position ``q`` is in batch ``q // (W*B)``.

1. **Which source.** Position ``q`` draws a uint32 from a counter-based generator: half
   ``q % 2`` (low first) of output ``(q % MIX_CHUNK) // 2`` of ``Philox(key, counter=(0,
   q // MIX_CHUNK, 0, 0))``, the key from ``SeedSequence([seed, epoch],
   spawn_key=(MIX_KEY,))``. Its source is the first ``s`` whose cumulative weight (in units
   of ``2**-32``) exceeds the draw, for the weights in force at ``q``. The draw never depends on the weights: a change at position ``k``
   changes nothing before ``k``.
2. **Which sample.** Each source has a stream, its passes one after the other; pass ``p`` is
   the job's shuffle of the source drawn from ``SeedSequence([seed, epoch],
   spawn_key=(SOURCE_KEY, s, p))`` (a source of at most ``SMALL_SOURCE`` samples draws
   ``SMALL_BLOCK // size`` passes at a time from the key of their block, see ``_Stream``). The ``c``-th position drawing ``s`` takes the ``c``-th
   element of the stream, except that elements quarantined at that position are skipped.
   Chunks are walked in order with one cursor per source: counts per chunk, never a Python
   loop per sample.
3. **Exhaustion.** A ``repeat`` source wraps into its next pass; a ``stop`` source that runs
   out ends the epoch before the position that would need one more of its samples, cut to a
   multiple of ``world_size`` so every rank gets the same number of samples.

Memory: the order (4 bytes a sample below 2**32 ids), each source's current pass (4 bytes a
source sample) and ~10 MB of chunk temporaries.

>>> sources = [MixSource(1000), MixSource(500)]
>>> order = mixture_order(sources, seed=0, epoch=0, length=600,
...                       segments=[Segment(0, (0.5, 0.5))], world_size=2)
>>> src, _ = split_ids(order, source_offsets(sources))
>>> len(order), 250 < int((src == 0).sum()) < 350
(600, True)
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from shardserve.proto.jobs import ShuffleMode

from .idset import IdSet
from .order import SHUFFLES, shard_sizes
from .partition import RankPlan
from .permute import stable_by_label
from .rng import order_dtype
from .shuffle_global import global_order_steps

#: Positions per counter block of the source draws. Part of the plan's definition: changing
#: it changes every mixture plan.
MIX_CHUNK = 1 << 16
#: ``spawn_key`` words that keep the mixture's generators apart from every other plan's.
MIX_KEY = 0x6D6978  # "mix"
SOURCE_KEY = 0x737263  # "src"
#: Bits of a draw compared against the cumulative weights: each uint64 of the generator
#: gives two draws (low half first), so a weight is resolved to 2**-32.
DRAW_BITS = 32
#: Most sources a mixture may have: source ids travel as int16 and the labels as uint8.
MAX_SOURCES = 64
#: Sources of at most this many samples draw their passes ``SMALL_BLOCK // size`` at a time
#: (see ``_Stream``). Part of the plan's definition, like ``MIX_CHUNK``.
SMALL_SOURCE = 4096
SMALL_BLOCK = 1 << 16
#: Up to this many sources, positions are grouped by one scan per source, else by a sort.
SCAN_SOURCES = 8
#: Positions assembled at once (whole chunks): fewer, larger numpy steps, a few MB each.
PIECE = 16 * MIX_CHUNK

Exhaustion = Literal["repeat", "stop"]


@dataclass(frozen=True)
class MixSource:
    """One source of a mixture as the planner sees it: its size and what happens at its end."""

    size: int
    on_exhausted: Exhaustion = "repeat"
    #: Rows per shard, for ``shuffle="block"`` (default: fixed-size shards).
    shard_rows: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Segment:
    """The weights in force from epoch position ``at`` until the next segment."""

    at: int
    weights: tuple[float, ...]


@dataclass(frozen=True)
class Quarantine:
    """Ids of source ``source`` skipped by every position from ``at`` on."""

    source: int
    at: int
    ids: np.ndarray = field(repr=False)  # sorted, unique, int64


def source_offsets(sources: Sequence[MixSource]) -> np.ndarray:
    """First id of each source in the concatenated id space, plus the total at the end.

    >>> source_offsets([MixSource(3), MixSource(5)]).tolist()
    [0, 3, 8]
    """
    out = np.zeros(len(sources) + 1, dtype=np.int64)
    np.cumsum([s.size for s in sources], out=out[1:])
    return out


def split_ids(ids: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(source int16, id within the source int64)`` of concatenated ids.

    >>> s, i = split_ids(np.array([0, 3, 7]), np.array([0, 3, 8]))
    >>> s.tolist(), i.tolist()
    ([0, 1, 1], [0, 0, 4])
    """
    src = np.searchsorted(offsets, ids, side="right") - 1
    return src.astype(np.int16), ids.astype(np.int64) - offsets[src]


def thresholds(weights: Sequence[float]) -> np.ndarray:
    """Cumulative weights as uint64 thresholds on a ``DRAW_BITS``-bit draw (last one omitted).

    >>> thresholds([1, 0, 1]).tolist() == [2**31, 2**31]
    True
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not len(w):
        raise ValueError(f"weights must be a non-empty 1-D sequence, got shape {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"weights must be finite and >= 0, got {w.tolist()}")
    total = float(w.sum())
    if total <= 0:
        raise ValueError(f"weights must sum to more than 0, got {w.tolist()}")
    cum = np.round(np.cumsum(w) / total * float(1 << DRAW_BITS))
    # A threshold of 2**32 (weight 0 at the end) is never reached by a uint32 draw.
    return np.minimum(cum, float(1 << DRAW_BITS)).astype(np.uint64)[:-1]


@functools.lru_cache(maxsize=256)
def _thresholds(weights: tuple[float, ...]) -> tuple[int, ...]:
    """:func:`thresholds` as ints, computed once per set of weights."""
    out: tuple[int, ...] = tuple(thresholds(weights).tolist())
    return out


def mix_key(seed: int, epoch: int) -> np.ndarray:
    """The Philox key of an epoch's source draws."""
    ss = np.random.SeedSequence([seed, epoch], spawn_key=(MIX_KEY,))
    key: np.ndarray = ss.generate_state(2, np.uint64)
    return key


def chunk_draws(key: np.ndarray, chunk: int, n: int) -> np.ndarray:
    """The first ``n`` raw uint64 draws of counter block ``chunk`` (positions
    ``chunk * MIX_CHUNK ...``) under ``key``: a pure function of its arguments."""
    gen = np.random.Philox(key=key, counter=np.array([0, chunk, 0, 0], dtype=np.uint64))
    out: np.ndarray = gen.random_raw(n)
    return out


def draw_sources(key: np.ndarray, lo: int, segments: Sequence[Segment]) -> np.ndarray:
    """Source labels (uint8) of positions ``lo .. lo + MIX_CHUNK``, ``lo`` a chunk start,
    under ``segments`` (sorted by ``at``, the first at or before ``lo``)."""
    chunk, rest = divmod(lo, MIX_CHUNK)
    if rest:
        raise ValueError(f"lo {lo} is not a multiple of MIX_CHUNK {MIX_CHUNK}")
    top = chunk_draws(key, chunk, MIX_CHUNK // 2).view("<u4")
    labels = np.zeros(MIX_CHUNK, dtype=np.uint8)
    ats = [s.at for s in segments]
    for k, seg in enumerate(segments):
        a = max(seg.at - lo, 0)
        b = MIX_CHUNK if k + 1 == len(segments) else min(max(ats[k + 1] - lo, 0), MIX_CHUNK)
        if a < b:
            # label = how many thresholds the draw reaches: the first s with u < cum[s]
            for t in _thresholds(seg.weights):
                if t < 1 << DRAW_BITS:  # 2**32: only zero weights follow, never reached
                    labels[a:b] += top[a:b] >= np.uint32(t)
    return labels


class _Stream:
    """A source's stream of sample ids: pass after pass, each its own permutation.

    The stream is stored a *segment* at a time: one pass of a source larger than
    ``SMALL_SOURCE``; ``SMALL_BLOCK // n`` passes of a smaller one, drawn together (one
    ``argsort`` of uniform keys per pass, a uniform permutation each), so a source of a few
    samples repeated millions of times costs a few vectorised blocks, not a loop per pass.
    """

    def __init__(
        self,
        index: int,
        source: MixSource,
        seed: int,
        epoch: int,
        shuffle: ShuffleMode,
        block_window: int,
        dtype: np.dtype,
    ) -> None:
        self.index = index
        self.dtype = dtype  # of the ids it hands out: the order's
        self.source = source
        self.cursor = 0  # stream elements consumed so far
        self._seed, self._epoch = seed, epoch
        self._shuffle, self._window = shuffle, block_window
        n = source.size
        self._passes = 1 if n > SMALL_SOURCE else max(SMALL_BLOCK // max(n, 1), 1)
        self.segment_len = n * self._passes
        self._g = -1
        self._segment = np.empty(0, dtype=np.uint32)
        # A global pass is shuffled a bucket at a time, as far as the plan reads it: the
        # buckets past the last position drawn are never shuffled (same bytes, less work).
        self._steps: Iterator[int] = iter(())
        self._final = 0

    def segment(self, g: int, upto: int) -> np.ndarray:
        """Segment ``g`` of the stream (passes ``g * k .. g * k + k - 1`` one after another),
        final at least in its first ``upto`` elements."""
        if g != self._g:
            n = self.source.size
            ss = np.random.SeedSequence(
                [self._seed, self._epoch], spawn_key=(SOURCE_KEY, self.index, g)
            )
            rng = np.random.Generator(np.random.PCG64(ss))
            self._final = self.segment_len
            if self._passes == 1 and self._shuffle == "global":
                self._segment, self._steps = global_order_steps(n, rng, dtype=order_dtype(n))
                self._final = 0
            elif self._passes == 1:
                rows = shard_sizes(n, self.source.shard_rows)
                self._segment = SHUFFLES[self._shuffle](
                    n, rng, dtype=order_dtype(n), shard_rows=rows, block_window=self._window
                )
            elif self._shuffle == "none":
                self._segment = np.tile(np.arange(n, dtype=np.uint32), self._passes)
            else:  # small: a window of shards is the whole source, so every mode is global
                keys = rng.random((self._passes, n))
                self._segment = np.argsort(keys, axis=1).astype(np.uint32).reshape(-1)
            self._g = g
        while self._final < upto:
            self._final = next(self._steps)
        return self._segment

    def peek(self, count: int) -> np.ndarray:
        """The next ``count`` elements (fewer if a ``stop`` source runs out), not consumed."""
        n = self.source.size
        stop = self.cursor + count
        if self.source.on_exhausted == "stop":
            stop = min(stop, n)
        out = np.empty(max(stop - self.cursor, 0), dtype=self.dtype)
        i, seg = self.cursor, self.segment_len
        while i < stop:  # one step per segment spanned
            g, j = divmod(i, seg)
            k = min(seg - j, stop - i)
            out[i - self.cursor : i - self.cursor + k] = self.segment(g, j + k)[j : j + k]
            i += k
        return out

    def take(self, count: int, banned: _BannedAt | None) -> tuple[np.ndarray, bool]:
        """The next ``count`` ids not in ``banned``; ``(ids, ran_out)``: fewer ids and
        ``ran_out`` when a ``stop`` source has no more."""
        if self.source.size == 0:
            return np.empty(0, dtype=self.dtype), True
        if banned is None or not len(banned):
            ids = self.peek(count)
            self.cursor += len(ids)
            return ids, len(ids) < count
        if self.source.on_exhausted == "repeat" and len(banned) >= self.source.size:
            raise ValueError(
                f"every sample of mixture source {self.index} ({self.source.size}) is quarantined"
            )
        got: list[np.ndarray] = []
        need = count
        while need:
            cand = self.peek(need + need // 8 + 16)
            if not len(cand):
                break  # a stop source ran out
            ok = banned.allows(cand)
            keep = np.flatnonzero(ok)[:need]
            # Consumed: up to and including the last id kept, or every candidate looked at.
            self.cursor += int(keep[-1]) + 1 if len(keep) == need else len(cand)
            got.append(cand[keep])
            need -= len(keep)
        ids = np.concatenate(got) if got else np.empty(0, dtype=self.dtype)
        return ids, len(ids) < count


def _check(sources: Sequence[MixSource], length: int, world_size: int) -> None:
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"a mixture has 1 to {MAX_SOURCES} sources, got {len(sources)}")
    for k, s in enumerate(sources):
        if s.size < 0:
            raise ValueError(f"source {k} size must be >= 0, got {s.size}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


class _Banned:
    """Each source's quarantined ids in force at a position: one :class:`IdSet` a source
    over every id, with the first position each is skipped from. Its size does not depend
    on how many quarantine positions there are (one bitmap a source, not one a position)."""

    def __init__(self, quarantine: Sequence[Quarantine], n_sources: int) -> None:
        self._sets: list[IdSet | None] = [None] * n_sources
        self._since: list[np.ndarray] = [np.empty(0, np.int64)] * n_sources
        for k in range(n_sources):
            mine = [q for q in quarantine if q.source == k]
            if not mine:
                continue
            ids = np.concatenate([np.asarray(q.ids, dtype=np.int64) for q in mine])
            at = np.concatenate([np.full(len(q.ids), q.at, dtype=np.int64) for q in mine])
            by = np.lexsort((at, ids))  # by id, then position: an id's earliest first
            ids, at = ids[by], at[by]
            first = np.concatenate(([True], ids[1:] != ids[:-1])) if len(ids) else ids
            self._sets[k], self._since[k] = IdSet(ids[first]), at[first]

    def at(self, source: int, position: int) -> _BannedAt | None:
        """The ids of ``source`` quarantined at ``position``, or ``None``."""
        ids = self._sets[source]
        if ids is None:
            return None
        count = int(np.count_nonzero(self._since[source] <= position))
        return _BannedAt(ids, self._since[source], position, count) if count else None


@dataclass(frozen=True)
class _BannedAt:
    """The ids of an :class:`IdSet` skipped at ``position`` (``since[i] <= position``)."""

    ids: IdSet
    since: np.ndarray
    position: int
    count: int

    def __len__(self) -> int:
        return self.count

    def allows(self, cand: np.ndarray) -> np.ndarray:
        """``True`` where a candidate id is not skipped at the position."""
        ok = self.ids.allows(cand)
        hit = np.flatnonzero(~ok)
        if len(hit) and self.count < len(self.ids):
            where = np.searchsorted(self.ids.ids, cand[hit].astype(np.int64))
            ok[hit] = self.since[where] > self.position
        return ok


def _draw_piece(key: np.ndarray, lo: int, hi: int, segments: Sequence[Segment]) -> np.ndarray:
    """Source labels of positions ``lo .. hi`` (``lo`` a chunk start): the chunks' draws."""
    labels = np.empty(hi - lo, dtype=np.uint8)
    for c in range(lo, hi, MIX_CHUNK):
        labels[c - lo : c - lo + MIX_CHUNK] = draw_sources(key, c, segments)[: hi - c]
    return labels


def _fill(
    dest: np.ndarray,
    piece: np.ndarray,
    a: int,
    streams: Sequence[_Stream],
    offsets: np.ndarray,
    banned: _Banned,
) -> int:
    """Write the ids of positions ``a ..`` (source labels ``piece``) into ``dest``; return the
    first position a ``stop`` source had no sample for (else int64's max). A piece taken at
    once or chunk by chunk takes the same ids: a stream hands out its elements in order."""
    end = np.iinfo(np.int64).max
    groups: Iterator[np.ndarray]
    if len(streams) <= SCAN_SOURCES:  # few sources: one scan each, no sort
        groups = (np.flatnonzero(piece == k) for k in range(len(streams)))
    else:
        by_source = stable_by_label(piece)
        ends = np.cumsum(np.bincount(piece, minlength=len(streams)))
        groups = iter(np.split(by_source, ends[:-1]))
    for k, where in enumerate(groups):
        if not len(where):
            continue
        ids, ran_out = streams[k].take(len(where), banned.at(k, a))
        if offsets[k]:
            ids += dest.dtype.type(offsets[k])  # fits: the order's dtype holds every id
        dest[where[: len(ids)]] = ids
        if ran_out:
            end = min(end, a + int(where[len(ids)]))  # the first position left without
    return end


def mixture_order(
    sources: Sequence[MixSource],
    seed: int,
    epoch: int,
    length: int,
    segments: Sequence[Segment],
    world_size: int = 1,
    quarantine: Sequence[Quarantine] = (),
    shuffle: ShuffleMode = "global",
    block_window: int = 4,
) -> np.ndarray:
    """Return the epoch's global mixture order over concatenated ids (see the module doc).

    ``segments``: the weights in force from each position on (the first at 0), sorted by
    position, one weight per source. ``quarantine``: ids skipped from a position on. The
    order is ``length`` long unless a ``stop`` source runs out first; it is then cut to a
    multiple of ``world_size``. Pure: the same arguments give the same order.
    """
    length, world_size = operator.index(length), operator.index(world_size)
    _check(sources, length, world_size)
    segs = sorted(segments, key=lambda s: s.at)
    if not segs or segs[0].at != 0:
        raise ValueError("segments must start at position 0")
    for s in segs:
        if len(s.weights) != len(sources):
            raise ValueError(
                f"segment at {s.at} has {len(s.weights)} weights for {len(sources)} sources"
            )
        thresholds(s.weights)  # refuse bad weights up front
    offsets = source_offsets(sources)
    dtype = order_dtype(int(offsets[-1]))
    streams = [
        _Stream(k, s, seed, epoch, shuffle, block_window, dtype) for k, s in enumerate(sources)
    ]
    out = np.empty(length, dtype=dtype)
    # Positions where something changes: pieces are cut there so that within one the
    # quarantine sets are constant (weights are applied per position by draw_sources).
    key = mix_key(seed, epoch)
    banned = _Banned(quarantine, len(sources))
    cuts = sorted({q.at for q in quarantine if 0 < q.at < length})
    end = length
    for lo in range(0, length, PIECE):
        hi = min(lo + PIECE, length)
        labels = _draw_piece(key, lo, hi, segs)
        bounds = [lo, *(c for c in cuts if lo < c < hi), hi]
        for a, b in itertools.pairwise(bounds):
            end = min(end, _fill(out[a:b], labels[a - lo : b - lo], a, streams, offsets, banned))
            if end < length:
                break
        if end < length:
            break
    if end < length:
        return out[: end - end % world_size].copy()
    return out


def mixture_plan(
    sources: Sequence[MixSource],
    seed: int,
    epoch: int,
    length: int,
    segments: Sequence[Segment],
    world_size: int,
    rank: int,
    batch_size: int,
    drop_last: bool = False,
    quarantine: Sequence[Quarantine] = (),
    shuffle: ShuffleMode = "global",
) -> RankPlan:
    """``rank``'s batches of a mixture epoch: :func:`mixture_order` dealt by ``RankPlan``.

    >>> p = mixture_plan([MixSource(8), MixSource(8)], 0, 0, 16, [Segment(0, (1, 1))],
    ...                  world_size=2, rank=0, batch_size=4)
    >>> len(p), p.num_samples
    (2, 8)
    """
    order = mixture_order(sources, seed, epoch, length, segments, world_size, quarantine, shuffle)
    return RankPlan.from_order(order, world_size, rank, batch_size, drop_last)


def source_counts(order: np.ndarray, offsets: np.ndarray, upto: int) -> list[int]:
    """Samples each source gave the first ``upto`` positions of ``order``: what a resume
    state records per source (``upto`` = steps consumed x world size x batch size), and
    what a server recomputes to check it.

    >>> source_counts(np.array([0, 5, 1, 6]), np.array([0, 5, 9]), upto=3)
    [2, 1]
    """
    src, _ = split_ids(order[: max(upto, 0)], offsets)
    counts: list[int] = np.bincount(src, minlength=len(offsets) - 1).tolist()
    return counts
