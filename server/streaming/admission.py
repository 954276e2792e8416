"""Who may open a stream now: one live stream per (job, rank), and the stream limits.

Decisions only (no socket); the handler acts on them. Checked after :func:`.handshake.check_hello`
(version, token, job, bounds) passed.

**One stream per (job, rank)**, or one per subscriber of a shared job's rank
(``spec.share``, see :mod:`.shares`): those are many Loaders on purpose. A Hello for a rank that another client's stream holds is
either a second process that resolved the same ``RANK`` (a launch bug: both would get the same
half of the data and the other half would never be served) or a trainer that was killed and
restarted faster than the server noticed. The two look the same at the Hello; they differ in
whether the holder is still alive. So the claim is *held* (no Welcome yet) while the server
probes the holder. Alive means its process is, not that its loop reads: a trainer may compute
for minutes (validation, a checkpoint save) without calling ``next()``. Liveness therefore comes
from libzmq's ZMTP heartbeats, which the holder's libzmq I/O thread answers on its own, not from
the protocol's Heartbeat messages, which only a loop waiting for data sends:

* the claimant is the holder's own process (same kernel boot id and pid in the Hello: a new
  Loader, or a reconnect on a new socket) -> it replaces its stream at once, and the holder
  gets a notice (a reconnect has closed that socket; another Loader logs it, and takes the
  rank back when it next reads);
* the holder speaks (a Credit or Heartbeat after the claim), or its connection is still up
  :attr:`Limits.alive_after_s` after the claim (libzmq would have dropped it had the process
  stopped answering PINGs, see :func:`.streamer.liveness_s`) -> it is alive: the claimant is
  refused with ``RankInUse`` (fatal), naming the rank, the world size and when the holder's
  stream opened; the server logs ``stream.rank_conflict`` and the status page shows it;
* the holder's connection is gone (killed: at once; frozen or partitioned: within
  ``alive_after_s``, when ZMTP drops it and a probe send fails with ``EHOSTUNREACH``) -> its
  stream is closed and the claimant gets the rank.

A restarted trainer therefore waits at most ``alive_after_s`` for its rank; a duplicate
process is refused within about a heartbeat while the holder waits for data, and within
``alive_after_s`` while it computes. Either way exactly one stream per rank receives batches,
and only a dead or partitioned process loses its rank.

A socket monitor (``EVENT_DISCONNECTED``) was the other way to learn of a dropped peer; it
names a file descriptor, not a routing id, so the stream it belongs to would have to be
guessed. A send with ``ROUTER_MANDATORY`` names the peer exactly.

**Limits** (each a setting; a refusal names it): open streams in total, streams per job
(never more than its world size), Hellos per peer per second. Memory: a stream holds at most
its credit in batches (``MAX_CREDIT`` caps a Hello), so the data plane holds at most
``max_streams x credit x batch bytes`` (``--max-batch-bytes`` caps a batch), plus the idle
buffer pools (``sinks.IDLE_POOL_BYTES``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from shardserve.proto.errors import ErrorCode
from shardserve.proto.messages import Error, Hello

from ..registry.jobs import Job
from .sessions import Session

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


@dataclass
class Claim:
    """A Hello held until the rank's current holder is known alive or gone."""

    ident: bytes
    hello: Hello
    job: Job
    holder: Session
    at: float = field(default_factory=time.monotonic)


def wall(t_monotonic: float) -> str:
    """A monotonic time as UTC wall-clock text, for messages."""
    t = time.time() - (time.monotonic() - t_monotonic)
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def rank_in_use(claim: Claim, now: float) -> Error:
    h = claim.holder
    ws = claim.job.spec.world_size
    return Error(
        code=ErrorCode.RANK_IN_USE,
        fatal=True,
        message=f"rank {h.rank} of job {h.job_id} (world size {ws}) is already streaming to "
        f"another live client, whose stream opened at {wall(h.opened)} "
        f"({now - h.opened:.0f} s ago): two processes claim this rank; give each process "
        f"its own RANK in 0..{ws - 1}",
    )


def fenced(s: Session, now: float) -> Error:
    """What is recorded (and would be told to the holder, were it reachable) when a claimant
    takes a rank whose holder's connection libzmq dropped."""
    return Error(
        code=ErrorCode.RANK_IN_USE,
        fatal=True,
        stream=s.stream,
        message=f"rank {s.rank} of job {s.job_id} was claimed by another client after this "
        f"stream's connection was dropped ({now - s.last_recv:.1f} s after it last spoke: "
        "its process died, froze or was cut off); this stream is closed",
    )


def taken_over(s: Session, hello: Hello) -> Error:
    """What the holder hears when a new stream of its own process takes its rank. A Loader's
    reconnect has closed the socket this goes to, so only another Loader of that process for
    the same (job, rank) receives it: a notice, not an error, since two Loaders used one
    after the other (an evaluation beside training, a check that a seed repeats) are fine;
    the client logs it, so that two used at once, each taking the rank back after a silence
    before its every batch, are not slow without a word."""
    return Error(
        code=ErrorCode.RANK_IN_USE,
        fatal=False,
        stream=s.stream,
        message=f"rank {s.rank} of job {s.job_id} was taken over by another Loader of this "
        f"process (pid {hello.pid}) for the same job and rank; the two take turns at it, each "
        "turn after a silence: to read one rank from two Loaders at once, give both the same "
        "share= name",
    )


def same_client(holder: Session, hello: Hello) -> bool:
    """Whether ``hello`` comes from the process that opened ``holder`` (a new Loader of the
    same process, or its reconnect on a new socket): it replaces its own stream at once."""
    return bool(hello.boot_id) and hello.pid > 0 and holder.client == (hello.boot_id, hello.pid)


def holder_of(sessions: Iterable[Session], job_id: str, rank: int, ident: bytes) -> Session | None:
    """Another peer's open stream of (job, rank), if any."""
    for s in sessions:
        if s.job_id == job_id and s.rank == rank and s.ident != ident and not s.closed:
            return s
    return None


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
