"""One pass for many subscribers: the batches of a shared job's rank, assembled once.

Loaders with the same job spec and ``share`` name (a sweep's trials, notebooks on one machine)
open one stream each, with their own credit, plan, sink and ``state_dict``. What they share is
the work: streams of one (job, rank, epoch, seed, offset, batches per message) form a
:class:`ShareGroup`, and a span of batches one of them takes is assembled once, on the group's
behalf, and handed to every member that takes the same span::

    member takes span i ─┬─ ready in the window ──────────> its sink fills it (a copy into its
                         │                                  slot; on the socket, the same buffer)
                         ├─ being assembled ──────────────> waits for it
                         ├─ not yet assembled, in window ─> assembles it for the group
                         │  (or below it, for members near)
                         └─ below the window, alone ──────> assembles it on its own (detached)

The window is the ``window`` batches below the *front*, the furthest span any member took.
The fastest member never waits for the slowest. Members behind the window share among
themselves (trials started together, a little after the first): a span below the window is
kept while another member will take it within ``window`` batches, up to one window more of
such spans. A member alone behind the window goes on on its own pass of the same plan (the
same bytes, no longer shared), is told so (a non-fatal ``share_detached`` notice) and rejoins
when it catches up. So memory is at most two windows' batches plus the spans being
assembled, whatever the members do; a group whose members all left keeps its window a few
seconds (:class:`ShareBook`).

Why each member has its own sink and not one ring mapped by all: a Loader hands out batches
that live in its slot, and a trainer may change a batch in place (``x.sub_(mean)``); pages
shared by several trainers would let one trial corrupt another's batches. A copy into each
member's own slot costs a memcpy, not a gather or a transform.

Plan positions are exact by construction: a member's batches come from its own plan, and a
span found in the window is the one that plan asks for (same key, same first index, same
length). Streamer thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from shardserve.proto.api import ShareStatus

from ..runtime.metrics import ShareSeries
from ..source import BatchParts
from .sinks import IDLE_KEEP_S, BatchSink

#: Groups without members kept at once (each holds at most two windows).
MAX_IDLE_GROUPS = 4

#: (job id, rank, epoch, seed, offset of the plan, batches per message): members of one group
#: take the same spans of the same plan.
ShareKey = tuple[str, int, int, int, int, int]


class Take(Enum):
    """What a member does for a span it takes."""

    #: Assembled already: fill the member's sink from the window.
    READY = "ready"
    #: Another member's assembly of it is running: wait for it.
    WAIT = "wait"
    #: Nobody has it: assemble it for the group.
    PRODUCE = "produce"
    #: Below the window with no member near (or spans that do not line up): its own
    #: assembly, not kept.
    OWN = "own"


@dataclass(frozen=True, slots=True)
class Waiter:
    """A member waiting for a span: its stream and the ticket of the memory it fills."""

    ident: bytes
    stream: int
    ticket: int
    sink: BatchSink


@dataclass(eq=False)
class Entry:
    """One span of the window: ``parts`` once assembled (``nbytes`` of them, counted against
    the server's :class:`Budget`); who waits for it meanwhile."""

    count: int
    parts: BatchParts | None = None
    waiters: list[Waiter] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class Budget:
    """Bytes every share group's window keeps together, at most ``limit``: a span past it is
    handed to its waiters and not kept (members behind it then assemble it on their own)."""

    limit: int = 1 << 62
    used: int = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


@dataclass
class Member:
    """One subscriber's place in its group."""

    stream: int
    #: The next batch it takes (the end of its last span).
    next: int
    detached: bool = False
    #: Batches it assembled on its own pass.
    own: int = 0


@dataclass(eq=False)
class ShareGroup:
    """The window and the members of one shared pass (see the module docstring)."""

    key: ShareKey
    #: Batches kept below the front.
    window: int
    share: str
    entries: dict[int, Entry] = field(default_factory=dict)
    members: dict[bytes, Member] = field(default_factory=dict)
    front: int = 0
    #: Batches assembled for the group (each once, however many members are handed it).
    assembled: int = 0
    #: Batches handed to members from the window (each hand-off saved an assembly).
    handed: int = 0
    #: Times a member fell below the window.
    detaches: int = 0
    #: Batches members that left assembled on their own passes.
    gone_own: int = 0
    #: The server's bytes for every group's window (see :class:`Budget`).
    budget: Budget = field(default_factory=Budget)

    @property
    def low(self) -> int:
        """The window's first batch: a span that starts below it is kept only for members
        that will take it soon."""
        return self.front - self.window

    def join(self, ident: bytes, stream: int, start: int) -> None:
        self.members[ident] = Member(stream, start)

    def leave(self, ident: bytes) -> None:
        if (m := self.members.pop(ident, None)) is not None:
            self.gone_own += m.own

    def take(self, ident: bytes, index: int, count: int) -> tuple[Take, Entry | None, bool]:
        """What member ``ident`` does for span (``index``, ``count``); the entry to fill
        from, wait on or produce into; and whether it was just detached (tell it so)."""
        m = self.members[ident]
        m.next = index + count
        self.front = max(self.front, m.next)
        e = self.entries.get(index)
        if e is not None and e.count == count:
            m.detached = False  # caught up again
            return (Take.READY if e.parts is not None else Take.WAIT), e, False
        if e is None and (index >= self.low or self._trailing(ident, index, count)):
            m.detached = False
            e = self.entries[index] = Entry(count)
            self._evict()
            return Take.PRODUCE, e, False
        # A span that starts below the window, and that no other member is near, was
        # assembled for the front and is gone; one that does not line up with the group's
        # (another length at this index) would be a second copy of the same batches.
        m.own += count
        newly = not m.detached
        m.detached = True
        self.detaches += newly
        self._evict()
        return Take.OWN, None, newly

    def _awaited(self, index: int, but: bytes | None = None) -> bool:
        """Whether a member (other than ``but``) will take the span at ``index`` within the
        window: its next batch is at most ``window`` batches before it."""
        return any(
            i != but and m.next <= index < m.next + self.window for i, m in self.members.items()
        )

    def _trailing(self, ident: bytes, index: int, count: int) -> bool:
        """Whether a span below the window is kept for members behind the front (trials that
        started late, together): another member will take it soon, and the spans kept below
        the window stay within one window more."""
        low = self.low
        below = sum(e.count for i, e in self.entries.items() if i < low)
        return below + count <= self.window and self._awaited(index, but=ident)

    def produced(self, index: int, parts: BatchParts) -> list[Waiter]:
        """The span at ``index`` is assembled; returns who waited for it."""
        e = self.entries.get(index)
        if e is None:
            return []
        self.assembled += e.count
        waiters, e.waiters = e.waiters, []
        nbytes = sum(a.nbytes for a in parts.values())
        if self.budget.take(nbytes):
            e.parts, e.nbytes = parts, nbytes
        else:
            del self.entries[index]  # over the server's budget: handed to its waiters only
        self._evict()
        return waiters

    def hand(self, count: int) -> None:
        """A member was handed ``count`` batches from the window."""
        self.handed += count

    def failed(self, index: int) -> list[Waiter]:
        """The span's assembly failed: forgotten (a later take assembles it again); returns
        who waited for it."""
        e = self.entries.pop(index, None)
        return e.waiters if e is not None else []

    def _evict(self) -> None:
        """Drop assembled spans below the window that no member will take soon, and past one
        window of them, the lowest (the members furthest behind go on on their own)."""
        low = self.low
        below = sorted((i for i, e in self.entries.items() if i + e.count <= low), reverse=True)
        kept = 0
        for i in below:
            e = self.entries[i]
            if e.parts is None:
                continue  # being assembled: its waiters get it, then it goes
            if kept + e.count <= self.window and self._awaited(i):
                kept += e.count
            else:
                self._forget(i)

    def _forget(self, index: int) -> None:
        e = self.entries.pop(index)
        self.budget.give(e.nbytes)

    def empty(self) -> None:
        """Forget every span (the group is dropped): their bytes go back to the budget."""
        for i in list(self.entries):
            self._forget(i)

    def lags(self) -> list[int]:
        """Each member's batches behind the front."""
        return sorted(self.front - m.next for m in self.members.values())

    @property
    def kept(self) -> int:
        """Batches in the window now."""
        return sum(e.count for e in self.entries.values() if e.parts is not None)

    def status(self) -> ShareStatus:
        _, rank, epoch, *_ = self.key
        return ShareStatus(
            share=self.share,
            rank=rank,
            epoch=epoch,
            subscribers=len(self.members),
            window=self.window,
            kept=self.kept,
            front=self.front,
            assembled=self.assembled,
            handed=self.handed,
            own=sum(m.own for m in self.members.values()) + self.gone_own,
            detaches=self.detaches,
            lags=self.lags(),
        )


class ShareBook:
    """Every share group of the server, by key. Streamer thread only.

    A group whose last member left is kept ``keep_s`` (at most ``max_idle`` such groups,
    oldest dropped first): a trial that ends its epoch before another starts it, or one that
    restarts, finds the window where the group left it.
    """

    def __init__(
        self,
        window: int,
        window_bytes: int,
        keep_s: float = IDLE_KEEP_S,
        max_idle: int = MAX_IDLE_GROUPS,
        total_bytes: int = 1 << 62,
    ) -> None:
        self.window = window
        self.window_bytes = window_bytes
        #: What all groups' windows keep together (``--share-bytes``).
        self.budget = Budget(total_bytes)
        self.keep_s = keep_s
        self.max_idle = max_idle
        self._groups: dict[ShareKey, ShareGroup] = {}
        #: Which group each member's stream is in.
        self._of: dict[bytes, ShareKey] = {}
        #: Groups without members, and since when (oldest first).
        self._idle: dict[ShareKey, float] = {}
        #: (handed, detaches) of the groups that ended, by (job id, rank): the counters of
        #: :meth:`series` only grow.
        self._ended: dict[tuple[str, int], tuple[int, int]] = {}

    def window_for(self, batch_bytes: int, group: int) -> int:
        """Batches a group of batches this big keeps: ``window``, fewer when they would pass
        ``window_bytes``, never fewer than two messages' worth (one read, one assembled)."""
        by_bytes = self.window_bytes // max(batch_bytes, 1)
        return max(2 * group, min(self.window, by_bytes))

    def join(
        self, key: ShareKey, share: str, ident: bytes, stream: int, start: int, batch_bytes: int
    ) -> ShareGroup:
        """Add a member's stream to the group of ``key`` (made if new)."""
        self.leave(ident)
        self._idle.pop(key, None)
        g = self._groups.get(key)
        if g is None:
            window = self.window_for(batch_bytes, key[5])
            g = self._groups[key] = ShareGroup(key, window, share, budget=self.budget)
        g.join(ident, stream, start)
        self._of[ident] = key
        return g

    def leave(self, ident: bytes, stream: int | None = None, now: float | None = None) -> None:
        """A member's stream closed (``stream``: only that one, not a newer stream of the same
        peer); a group without members is kept for a while (see the class docstring)."""
        key = self._of.get(ident)
        if key is None:
            return
        g = self._groups[key]
        if stream is not None and (m := g.members.get(ident)) is not None and m.stream != stream:
            return
        del self._of[ident]
        g.leave(ident)
        if not g.members:
            self._idle[key] = time.monotonic() if now is None else now
            while len(self._idle) > self.max_idle:
                self._drop(next(iter(self._idle)))

    def expire(self, now: float) -> None:
        """Drop groups that have had no member for ``keep_s``."""
        for key, since in list(self._idle.items()):
            if now - since >= self.keep_s:
                self._drop(key)

    def _drop(self, key: ShareKey) -> None:
        self._idle.pop(key, None)
        g = self._groups.pop(key, None)
        if g is None:
            return
        g.empty()
        for ident in g.members:
            self._of.pop(ident, None)
        handed, detaches = self._ended.get(key[:2], (0, 0))
        self._ended[key[:2]] = (handed + g.handed, detaches + g.detaches)

    def series(self) -> list[ShareSeries]:
        """Per (job, rank) of a shared job: subscribers and the largest lag now, batches
        handed and detaches since the server started."""
        live: dict[tuple[str, int], list[ShareGroup]] = {}
        for key, g in self._groups.items():
            live.setdefault(key[:2], []).append(g)
        out = []
        for job_rank in sorted(live.keys() | self._ended.keys()):
            gs = live.get(job_rank, [])
            handed, detaches = self._ended.get(job_rank, (0, 0))
            out.append(
                ShareSeries(
                    *job_rank,
                    subscribers=sum(len(g.members) for g in gs),
                    lag=max((lag for g in gs for lag in g.lags()), default=0),
                    handed=handed + sum(g.handed for g in gs),
                    detaches=detaches + sum(g.detaches for g in gs),
                )
            )
        return out

    def spans_of(self, plan: tuple[str, int, int, int, int]) -> int | None:
        """Batches per message of the group with the most members streaming ``plan`` (the
        key without its last element), if there is one: a new member takes that length when
        its credit allows, so that it shares spans with them."""
        best = max(
            (g for k, g in self._groups.items() if k[:5] == plan),
            key=lambda g: len(g.members),
            default=None,
        )
        return best.key[5] if best is not None else None

    def get(self, key: ShareKey) -> ShareGroup | None:
        return self._groups.get(key)

    def statuses(self) -> dict[str, list[ShareStatus]]:
        """Every group's status, by job id (ordered by rank, epoch, share)."""
        out: dict[str, list[ShareStatus]] = {}
        for key in sorted(self._groups):
            out.setdefault(key[0], []).append(self._groups[key].status())
        return out

    def forget_job(self, job_id: str) -> None:
        for key in [k for k in self._groups if k[0] == job_id]:
            self._drop(key)
        for job_rank in [k for k in self._ended if k[0] == job_id]:
            del self._ended[job_rank]
