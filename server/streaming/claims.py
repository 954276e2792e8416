"""One stream per (job, rank): who holds a rank, and what each side of a claim is told.

Pure rules (no socket, no session table of their own); :class:`~.admission.Admission` applies
them to a Hello.

**One stream per (job, rank)**, or one per subscriber of a shared job's rank (``spec.share``,
see :mod:`.shares`): those are many Loaders on purpose. A Hello for a rank that another client's
stream holds is either a second process that resolved the same ``RANK`` (a launch bug: both
would get the same half of the data and the other half would never be served) or a trainer that
was killed and restarted faster than the server noticed. The two look the same at the Hello;
they differ in whether the holder is still alive. So the claim is *held* (no Welcome yet) while
the server probes the holder. Alive means its process is, not that its loop reads: a trainer may
compute for minutes (validation, a checkpoint save) without calling ``next()``. Liveness
therefore comes from libzmq's ZMTP heartbeats, which the holder's libzmq I/O thread answers on
its own, not from the protocol's Heartbeat messages, which only a loop waiting for data sends:

* the claimant is the holder's own process (same kernel boot id and pid in the Hello: a new
  Loader, or a reconnect on a new socket) -> it replaces its stream at once, and the holder
  gets a notice (a reconnect has closed that socket; another Loader logs it, and takes the
  rank back when it next reads);
* the holder speaks (a Credit or Heartbeat after the claim), or its connection is still up
  :attr:`.admission.Limits.alive_after_s` after the claim (libzmq would have dropped it had the
  process stopped answering PINGs, see :func:`.streamer.liveness_s`) -> it is alive: the
  claimant is refused with ``RankInUse`` (fatal), naming the rank, the world size and when the
  holder's stream opened; the server logs ``stream.rank_conflict`` and the status page shows it;
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
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from shardserve.proto.errors import ErrorCode
from shardserve.proto.messages import Error, Hello

from ..registry.jobs import Job
from .sessions import Session


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
