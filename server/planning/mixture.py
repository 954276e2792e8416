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
   ``SMALL_BLOCK // size`` passes at a time from the key of their block, see
   :mod:`.mixture_stream`). The ``c``-th position drawing ``s`` takes the ``c``-th element of
   the stream, except that elements quarantined at that position are skipped.
   Chunks are walked in order with one cursor per source: counts per chunk, never a Python
   loop per sample.
3. **Exhaustion.** A ``repeat`` source wraps into its next pass; a ``stop`` source that runs
   out ends the epoch before the position that would need one more of its samples, cut to a
   multiple of ``world_size`` so every rank gets the same number of samples.

Time: from ``PREFETCH_MIN`` positions on, the sources' passes are shuffled on a second thread
(:mod:`.mixture_prefetch`) while this one draws and places positions; who shuffles what
changes no byte. 40 M positions from three sources take about the time of one global order of
40 M on two cores (``bench/bench_plan.py``).

Memory: the order (4 bytes a sample below 2**32 ids), each source's current pass (4 bytes a
source sample), a byte a sample of the (at most two) passes being laid out, and ~20 MB of
temporaries.

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
from dataclasses import dataclass

import numpy as np

from shardserve.proto.jobs import ShuffleMode

from .mixture_prefetch import Drawn, PieceQueue, Prefetcher
from .mixture_quarantine import Quarantine, QuarantineSets
from .mixture_stream import (
    SMALL_BLOCK,
    SMALL_SOURCE,
    SOURCE_KEY,
    Meanwhile,
    MixSource,
    SourceStream,
)
from .partition import RankPlan
from .permute import stable_by_label
from .rng import order_dtype

__all__ = [
    "DRAW_BITS",
    "MAX_SOURCES",
    "MIX_CHUNK",
    "MIX_KEY",
    "SMALL_BLOCK",
    "SMALL_SOURCE",
    "SOURCE_KEY",
    "MixSource",
    "Quarantine",
    "Segment",
    "chunk_draws",
    "draw_sources",
    "mix_key",
    "mixture_order",
    "mixture_plan",
    "source_counts",
    "source_offsets",
    "split_ids",
    "thresholds",
]

#: Positions per counter block of the source draws. Part of the plan's definition: changing
#: it changes every mixture plan.
MIX_CHUNK = 1 << 16
#: ``spawn_key`` word that keeps the mixture's draws apart from every other plan's.
MIX_KEY = 0x6D6978  # "mix"
#: Bits of a draw compared against the cumulative weights: each uint64 of the generator
#: gives two draws (low half first), so a weight is resolved to 2**-32.
DRAW_BITS = 32
#: Most sources a mixture may have: source ids travel as int16 and the labels as uint8.
MAX_SOURCES = 64
#: Up to this many sources, positions are grouped by one scan per source, else by a sort.
SCAN_SOURCES = 8
#: Positions assembled at once (whole chunks): fewer, larger numpy steps, a few MB each.
PIECE = 16 * MIX_CHUNK
#: From this many positions on, the sources are shuffled on a second thread meanwhile.
PREFETCH_MIN = 4 * PIECE


@dataclass(frozen=True)
class Segment:
    """The weights in force from epoch position ``at`` until the next segment."""

    at: int
    weights: tuple[float, ...]


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


def _checked(
    sources: Sequence[MixSource], length: int, world_size: int, segments: Sequence[Segment]
) -> list[Segment]:
    """The segments sorted by position, once the arguments are checked."""
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"a mixture has 1 to {MAX_SOURCES} sources, got {len(sources)}")
    for k, s in enumerate(sources):
        if s.size < 0:
            raise ValueError(f"source {k} size must be >= 0, got {s.size}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    segs = sorted(segments, key=lambda s: s.at)
    if not segs or segs[0].at != 0:
        raise ValueError("segments must start at position 0")
    for seg in segs:
        if len(seg.weights) != len(sources):
            raise ValueError(
                f"segment at {seg.at} has {len(seg.weights)} weights for {len(sources)} sources"
            )
        thresholds(seg.weights)  # refuse bad weights up front
    return segs


def _draws(key: np.ndarray, length: int, segments: Sequence[Segment]) -> Iterator[Drawn]:
    """Each piece's first position and source labels: the chunks' draws, a piece at a time."""
    for lo in range(0, length, PIECE):
        hi = min(lo + PIECE, length)
        labels = np.empty(hi - lo, dtype=np.uint8)
        for c in range(lo, hi, MIX_CHUNK):
            labels[c - lo : c - lo + MIX_CHUNK] = draw_sources(key, c, segments)[: hi - c]
        yield lo, labels


@dataclass
class _Placer:
    """Writes the ids of an epoch's positions into ``out``, piece after piece."""

    out: np.ndarray
    streams: Sequence[SourceStream]
    offsets: np.ndarray
    skipped: QuarantineSets
    #: Positions where a quarantine starts: pieces are cut there so that within one the
    #: quarantine sets are constant (weights are applied per position by draw_sources).
    cuts: Sequence[int]
    meanwhile: Meanwhile | None = None

    def run(self, pieces: Iterator[Drawn]) -> int:
        """Place every piece; return the first position a ``stop`` source had no sample
        for, or ``len(out)``."""
        length = len(self.out)
        for lo, labels in pieces:
            hi = lo + len(labels)
            bounds = [lo, *(c for c in self.cuts if lo < c < hi), hi]
            for a, b in itertools.pairwise(bounds):
                end = self.fill(a, labels[a - lo : b - lo])
                if end < length:
                    return end
        return length

    def fill(self, a: int, piece: np.ndarray) -> int:
        """Write the ids of positions ``a ..`` (source labels ``piece``); return the first
        position a ``stop`` source had no sample for (else int64's max). A piece taken at
        once or chunk by chunk takes the same ids: a stream hands out its elements in order."""
        end = np.iinfo(np.int64).max
        dest = self.out[a : a + len(piece)]
        for k, where in enumerate(_groups(piece, len(self.streams))):
            if not len(where):
                continue
            stream = self.streams[k]
            ids, ran_out = stream.take(len(where), self.skipped.at(k, a), self.meanwhile)
            if self.offsets[k]:  # fits: the dtype holds every id
                ids = ids + dest.dtype.type(self.offsets[k])
            dest[where[: len(ids)]] = ids
            if ran_out:
                end = min(end, a + int(where[len(ids)]))  # the first position left without
        return end


def _groups(piece: np.ndarray, n_sources: int) -> Iterator[np.ndarray]:
    """The positions of ``piece`` that drew each source, in order, source by source."""
    if n_sources <= SCAN_SOURCES:  # few sources: one scan each, no sort
        return (np.flatnonzero(piece == k) for k in range(n_sources))
    by_source = stable_by_label(piece)
    ends = np.cumsum(np.bincount(piece, minlength=n_sources))
    return iter(np.split(by_source, ends[:-1]))


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
    multiple of ``world_size``. Pure: the same arguments give the same order (from
    ``PREFETCH_MIN`` positions on, computed on two threads).
    """
    length, world_size = operator.index(length), operator.index(world_size)
    segs = _checked(sources, length, world_size, segments)
    offsets = source_offsets(sources)
    dtype = order_dtype(int(offsets[-1]))
    streams = [
        SourceStream(k, s, seed, epoch, shuffle, block_window, dtype) for k, s in enumerate(sources)
    ]
    cuts = sorted({q.at for q in quarantine if 0 < q.at < length})
    placer = _Placer(
        np.empty(length, dtype=dtype),
        streams,
        offsets,
        QuarantineSets(quarantine, len(sources)),
        cuts,
    )
    pieces = _draws(mix_key(seed, epoch), length, segs)
    if length < PREFETCH_MIN:
        end = placer.run(pieces)
    else:
        queue = PieceQueue(pieces, len(streams))
        with Prefetcher(streams, queue) as prefetch:
            placer.meanwhile = prefetch.help
            end = placer.run(queue.read(prefetch.want))
    if end < length:
        return placer.out[: end - end % world_size].copy()
    return placer.out


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
