"""Who may open a stream now: :class:`Admission` decides each Hello, under the stream limits
and the Hello rate, and the rank claims of :mod:`.claims`.

Checked in this order: the peer's Hello rate (:class:`HelloRate`: an excess Hello waits for
the peer's next token), the Hello itself (:func:`.handshake.check_hello`: version, token, job,
bounds), this process's gate (``HandlerDeps.gate``), the stream limits
(:func:`limit_refusal`), and who holds the rank (:mod:`.claims`: a claim on a live holder's
rank is held while the holder is probed). What passes is opened by the host.

The object reaches the streams only through :class:`AdmissionHost` (the session table,
sending a reply, probing, closing and opening a stream). :class:`~.handler.StreamHandler` is
that host today; admission that moves to the main process (see
``docs/concepts/streaming-processes.md``) keeps this object and gets a host whose table the
streaming processes keep current and whose close, probe and open go over their links.

**Limits** (each a setting; a refusal names it): open streams in total, streams per job
(never more than its world size), Hellos per peer per second. Memory: a stream holds at most
its credit in batches (``MAX_CREDIT`` caps a Hello), so the data plane holds at most
``max_streams x credit x batch bytes`` (``--max-batch-bytes`` caps a batch), plus the idle
buffer pools (``sinks.IDLE_POOL_BYTES``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from shardserve.proto.errors import ErrorCode
from shardserve.proto.messages import ControlMessage, Error, Hello

from ..registry.jobs import Job
from .claims import Claim, fenced, holder_of, rank_in_use, same_client, taken_over
from .handshake import check_hello
from .notices import StreamNotices
from .sessions import Gate, Session, StreamJobs

#: Peers whose Hello rate is remembered at most (oldest forgotten first).
RATE_PEERS = 4096


@dataclass(frozen=True)
class Limits:
    """The data plane's admission limits (from ``Settings``)."""

    max_streams: int = 1024
    #: 0: a job's world size.
    max_streams_per_job: int = 0
    #: A claimed rank's holder whose connection outlives the claim by this long is alive
    #: (:func:`.streamer.liveness_s`: libzmq drops a silent peer's connection sooner).
    alive_after_s: float = 12.0
    #: Streams one rank of a shared job may have (its share group's subscribers).
    share_subscribers: int = 16


def limit_refusal(
    limits: Limits, sessions: Iterable[Session], job: Job, rank: int, ident: bytes, held: int = 0
) -> Error | None:
    """The refusal for a new stream of (``job``, ``rank``) past a stream limit, or ``None``.

    The peer's own stream (a new Hello replaces it) and the rank's current holder (the claim
    either replaces it or is refused) are not counted; ``held``: Hellos waiting on a rank's
    holder (they count against the total). A shared job's rank has no single holder: its
    subscribers all count, up to ``share_subscribers`` a rank.
    """
    shared = job.spec.share is not None
    others = [
        s
        for s in sessions
        if s.ident != ident and (shared or not (s.job_id == job.id and s.rank == rank))
    ]
    if len(others) + held >= limits.max_streams:
        return Error(
            code=ErrorCode.STREAM_LIMIT,
            fatal=True,
            message=f"the server already serves {len(others)} streams (and holds {held} "
            f"Hellos), its limit of {limits.max_streams} (--max-streams): close idle Loaders "
            "or raise the limit",
        )
    ws = job.spec.world_size
    subs = limits.share_subscribers if shared else 1
    cap = min(limits.max_streams_per_job or ws * subs, ws * subs)
    if shared and (n := sum(s.job_id == job.id and s.rank == rank for s in others)) >= subs:
        return Error(
            code=ErrorCode.STREAM_LIMIT,
            fatal=True,
            message=f"rank {rank} of job {job.id} (share {job.spec.share!r}) already has {n} "
            f"subscribers, the limit (--share-subscribers {subs})",
        )
    mine = sum(s.job_id == job.id for s in others)
    if mine >= cap:
        return Error(
            code=ErrorCode.STREAM_LIMIT,
            fatal=True,
            message=f"job {job.id} already has {mine} streams, its limit of {cap} (world size "
            f"{ws}, --max-streams-per-job {limits.max_streams_per_job or 'unset'}"
            + (f", --share-subscribers {subs})" if shared else ")"),
        )
    return None


class HelloRate:
    """Hellos per peer per second, a token bucket per routing id (burst: one second's).

    A Hello over the rate is not dropped but *deferred*: the peer's newest Hello waits for its
    next token (each Hello replaces the previous one anyway), and one it supersedes is answered
    with a non-fatal ``stream_limit`` Error. So a flooding peer costs the server at most
    ``per_s`` Hellos a second and one stored Hello, and is still served its last one.
    """

    def __init__(self, per_s: float) -> None:
        self.per_s = per_s
        self._buckets: dict[bytes, tuple[float, float]] = {}  # ident -> (tokens, at)
        self.deferred: dict[bytes, Hello] = {}

    def allow(self, ident: bytes, now: float) -> bool:
        """Take a token for one Hello of ``ident`` now, if it has one."""
        tokens, at = self._buckets.pop(ident, (self.per_s, now))
        tokens = min(self.per_s, tokens + (now - at) * self.per_s)
        ok = tokens >= 1.0
        self._buckets[ident] = (tokens - 1.0 if ok else tokens, now)  # newest last
        while len(self._buckets) > RATE_PEERS:
            old = next(iter(self._buckets))
            del self._buckets[old]
            self.deferred.pop(old, None)
        return ok

    def defer(self, ident: bytes, hello: Hello) -> Hello | None:
        """Keep ``hello`` for the peer's next token; returns the Hello it supersedes."""
        superseded = self.deferred.pop(ident, None)
        self.deferred[ident] = hello
        return superseded

    def due(self, now: float) -> list[tuple[bytes, Hello]]:
        """Deferred Hellos whose peer has a token again (the token is taken)."""
        ready = [i for i in list(self.deferred) if self.allow(i, now)]
        return [(i, self.deferred.pop(i)) for i in ready]

    def refusal(self) -> Error:
        return Error(
            code=ErrorCode.STREAM_LIMIT,
            fatal=False,
            message=f"more than {self.per_s:g} Hellos a second from this peer "
            "(--max-hellos-per-s): this one was superseded by a newer Hello before its turn",
        )


class AdmissionHost(Protocol):
    """What admission asks of the streams it admits: the handler's session table and four
    acts on it. Streamer thread only."""

    @property
    def sessions(self) -> Mapping[bytes, Session]:
        """The open streams by routing id (read only: opening and closing go through here)."""
        ...

    def send(self, ident: bytes, msg: ControlMessage) -> bool:
        """Answer peer ``ident``; ``False`` when it is gone (its stream is then closed) or its
        queue is full."""
        ...

    def probe(self, s: Session, now: float) -> None:
        """Ask whether ``s``'s peer is still there: once libzmq has dropped its connection
        the probe fails and ``s`` is closed (gone from :attr:`sessions`)."""

    def close(
        self, s: Session, reason: str, level: int = logging.INFO, handover: bool = False
    ) -> None:
        """End ``s`` for ``reason``; ``handover``: its client's next stream may take over
        its slot ring."""

    def open(self, ident: bytes, job: Job, hello: Hello) -> None:
        """Open the stream ``hello`` asks for (it passed every check), replacing none."""

    def drop_ring(self, ident: bytes) -> None:
        """No stream opens for ``ident`` now: the ring its last stream left for a handover
        goes."""


class Admission:
    """What to do with each Hello: defer it past its peer's rate, refuse it, hold it while a
    rank's holder is probed, or have the host open its stream. Streamer thread only.

    It keeps the Hellos it has not decided yet (deferred by the rate, held on a holder); the
    streams are the host's::

        admission = Admission(handler, registry, gate, token, notices, Limits(), HelloRate(20))
        admission.hello(ident, hello)  # answered, deferred, held, or opened by the host
        admission.tick(time.monotonic())  # deferred Hellos due, held claims decidable
    """

    def __init__(
        self,
        host: AdmissionHost,
        jobs: StreamJobs,
        gate: Gate,
        token: str | None,
        notices: StreamNotices,
        limits: Limits,
        rate: HelloRate,
    ) -> None:
        self.host = host
        self.jobs = jobs
        self.gate = gate
        self.token = token
        self.notices = notices
        self.limits = limits
        self.rate = rate
        #: Hellos for a rank another client holds, until it is known alive or gone.
        self.claims: dict[bytes, Claim] = {}

    def hello(self, ident: bytes, hello: Hello) -> None:
        """A Hello from peer ``ident``: decide it now, or keep it for the peer's next token."""
        now = time.monotonic()
        if not self.rate.allow(ident, now):
            if self.rate.defer(ident, hello) is not None:
                self._superseded(ident)
            return
        if self.rate.deferred.pop(ident, None) is not None:
            # The older Hello still waiting would otherwise be admitted after this one and
            # replace its stream; it is answered now, before this one, in the order they came.
            self._superseded(ident)
        self._admit(ident, hello, now)

    def tick(self, now: float) -> None:
        """Deferred Hellos whose peer may say Hello again, and held claims now decidable."""
        for ident, hello in self.rate.due(now):
            self._admit(ident, hello, now)
        for claim in list(self.claims.values()):
            if self.claims.get(claim.ident) is claim and self._settle(claim, now):
                del self.claims[claim.ident]

    def holds(self, ident: bytes) -> bool:
        """Whether ``ident``'s Hello waits on a rank's holder (slow, not an unknown stream)."""
        return ident in self.claims

    def forget(self, ident: bytes) -> None:
        """Peer ``ident`` said goodbye: its Hellos not yet decided are dropped unanswered."""
        self.claims.pop(ident, None)
        self.rate.deferred.pop(ident, None)

    def _superseded(self, ident: bytes) -> None:
        self.host.send(ident, refusal := self.rate.refusal())
        self.notices.hello_limited(ident, refusal)

    def _admit(self, ident: bytes, hello: Hello, now: float) -> None:
        host = self.host
        prev = self.claims.pop(ident, None)  # a new Hello replaces the peer's held one
        job = self.jobs.find(hello.job)
        refusal = self.gate(hello) or check_hello(hello, job, self.token)
        if (old := host.sessions.get(ident)) is not None:
            # The same client's next stream (an epoch, a resume) may take over its ring, unless
            # a worker may still be writing into one of its slots.
            host.close(old, "replaced by a new Hello", handover=refusal is None)
        if refusal is None and job is not None:
            held = len(self.claims)
            refusal = limit_refusal(
                self.limits, host.sessions.values(), job, hello.rank, ident, held
            )
        if refusal is not None or job is None:
            host.drop_ring(ident)
            if refusal is not None:
                host.send(ident, refusal)
                self.notices.refused(hello, refusal)
            return
        # A shared job's rank is many subscribers' on purpose: no holder to probe.
        shared = job.spec.share is not None
        holder = None if shared else holder_of(host.sessions.values(), job.id, hello.rank, ident)
        if holder is None:
            host.open(ident, job, hello)
            return
        # Another client holds the rank: alive (refuse this one) or gone (fence it)?
        since = prev.at if prev is not None and prev.holder is holder else now
        claim = Claim(ident, hello, job, holder, since)
        if not self._settle(claim, now):  # its first probe of the holder
            self.claims[ident] = claim

    def _settle(self, claim: Claim, now: float) -> bool:
        """Decide a held claim if its holder is known alive or gone; ``False``: not yet."""
        host, h = self.host, claim.holder
        if host.sessions.get(h.ident) is h:
            if same_client(h, claim.hello):
                host.send(h.ident, taken_over(h, claim.hello))
                host.close(h, "replaced by a new stream of its process")
            else:
                spoke = h.last_recv > claim.at
                # A probe fails (and closes the holder's stream) once libzmq has dropped the
                # connection of a dead, frozen or partitioned process.
                if not spoke:
                    host.probe(h, now)
                if host.sessions.get(h.ident) is not h:
                    self.notices.fenced(h, claim.ident, fenced(h, now))
                elif spoke or now - claim.at >= self.limits.alive_after_s:
                    # It spoke since the claim, or its libzmq kept answering ZMTP PINGs for
                    # longer than a silent peer's connection survives: alive (perhaps computing).
                    host.send(claim.ident, refusal := rank_in_use(claim, now))
                    self.notices.rank_conflict(h, claim.ident, refusal)
                    return True
                else:
                    return False
        host.open(claim.ident, claim.job, claim.hello)
        return True
