"""Handling a Hello on the streamer thread: the checks, the limits, a rank held by another
client (see :mod:`.admission`), and opening the session whose plan is then prepared.

A part of :class:`~.handler.StreamHandler` (a base class of it), kept apart so the handler's
module stays about dispatch and the life of open streams.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from shardserve.proto.messages import Heartbeat, Hello

from ..reading.assembly import Assembler
from ..registry.jobs import Job
from .admission import (
    Claim,
    HelloRate,
    Limits,
    fenced,
    holder_of,
    limit_refusal,
    rank_in_use,
    same_client,
    taken_over,
)
from .handshake import check_hello
from .notices import StreamNotices
from .opening import Opener
from .pipeline import Work, WorkKind
from .replies import Outbox
from .sessions import HandlerDeps, Session, prepare
from .streamer import StreamerConfig


class HelloHandling:
    """Hellos: admit, hold or refuse them, and open sessions. Streamer thread only."""

    sessions: dict[bytes, Session]
    config: StreamerConfig
    assembler: Assembler[Work]
    out: Outbox
    notices: StreamNotices
    opener: Opener
    limits: Limits
    rate: HelloRate
    #: Hellos for a rank another client holds, until it is known alive or gone.
    claims: dict[bytes, Claim]

    deps: HandlerDeps

    if TYPE_CHECKING:  # the handler's own, used here

        def _close(
            self, s: Session, reason: str, level: int = logging.INFO, handover: bool = False
        ) -> None: ...

        def _new_stream_id(self) -> int: ...

    def _admission_tick(self, now: float) -> None:
        """Deferred Hellos whose peer may say Hello again, and held claims now decidable."""
        for ident, hello in self.rate.due(now):
            self._admit(ident, hello, now)
        for claim in list(self.claims.values()):
            if self.claims.get(claim.ident) is claim and self._settle(claim, now):
                del self.claims[claim.ident]

    def _on_hello(self, ident: bytes, hello: Hello) -> None:
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

    def _superseded(self, ident: bytes) -> None:
        self.out.send(ident, refusal := self.rate.refusal())
        self.notices.hello_limited(ident, refusal)

    def _admit(self, ident: bytes, hello: Hello, now: float) -> None:
        prev = self.claims.pop(ident, None)  # a new Hello replaces the peer's held one
        job = self.deps.registry.find(hello.job)
        refusal = self.deps.gate(hello) or check_hello(hello, job, self.config.token)
        if (old := self.sessions.get(ident)) is not None:
            # The same client's next stream (an epoch, a resume) may take over its ring, unless
            # a worker may still be writing into one of its slots.
            self._close(old, "replaced by a new Hello", handover=refusal is None)
        if refusal is None and job is not None:
            held = len(self.claims)
            refusal = limit_refusal(
                self.limits, self.sessions.values(), job, hello.rank, ident, held
            )
        if refusal is not None or job is None:
            self.opener.rings.discard(ident)
            if refusal is not None:
                self.out.send(ident, refusal)
                self.notices.refused(hello, refusal)
            return
        # A shared job's rank is many subscribers' on purpose: no holder to probe.
        shared = job.spec.share is not None
        holder = None if shared else holder_of(self.sessions.values(), job.id, hello.rank, ident)
        if holder is None:
            self._open(ident, job, hello)
            return
        # Another client holds the rank: alive (refuse this one) or gone (fence it)?
        since = prev.at if prev is not None and prev.holder is holder else now
        claim = Claim(ident, hello, job, holder, since)
        if not self._settle(claim, now):  # its first probe of the holder
            self.claims[ident] = claim

    def _settle(self, claim: Claim, now: float) -> bool:
        """Decide a held claim if its holder is known alive or gone; ``False``: not yet."""
        h = claim.holder
        if self.sessions.get(h.ident) is h:
            if same_client(h, claim.hello):
                self.out.send(h.ident, taken_over(h, claim.hello))
                self._close(h, "replaced by a new stream of its process")
            else:
                spoke = h.last_recv > claim.at
                # A probe: the send fails (and closes the holder's stream) once libzmq has
                # dropped the connection of a dead, frozen or partitioned process.
                if not spoke and self.out.send(h.ident, Heartbeat()):
                    h.sent(now)
                if self.sessions.get(h.ident) is not h:
                    self.notices.fenced(h, claim.ident, fenced(h, now))
                elif spoke or now - claim.at >= self.limits.alive_after_s:
                    # It spoke since the claim, or its libzmq kept answering ZMTP PINGs for
                    # longer than a silent peer's connection survives: alive (perhaps computing).
                    self.out.send(claim.ident, refusal := rank_in_use(claim, now))
                    self.notices.rank_conflict(h, claim.ident, refusal)
                    return True
                else:
                    return False
        self._open(claim.ident, claim.job, claim.hello)
        return True

    def _open(self, ident: bytes, job: Job, hello: Hello) -> None:
        s = self.opener.session(ident, self._new_stream_id(), job, hello)
        if not s.want_shm:
            self.opener.rings.discard(ident)
        self.sessions[ident] = s
        self.deps.registry.note_stream(job.id, s.epoch, hello.origin)
        # Welcome waits for the prepared plan (and the slot ring, sized from the dataset).
        # Planning has its own lane, so a flood of Hellos cannot starve other jobs' batches;
        # a Hello replaced (or a peer gone) before its turn costs nothing (see prepare).
        work = Work(WorkKind.PREPARE, ident, s.stream)
        d = self.deps
        self.assembler.plan(work, prepare, s, d.open_source, d.kind_of, self.config.max_batch_bytes)

    def _welcome(self, s: Session) -> None:
        self.out.send(s.ident, self.opener.welcome(s))
        self.notices.opened(s, len(self.sessions))
