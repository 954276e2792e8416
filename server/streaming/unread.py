"""Memory held for streams that have not read: bounded per stream and server-wide.

A Hello grants credit (up to ``MAX_CREDIT`` batches) before its client has shown it reads
anything. Spent at once, that credit is memory the server holds for the stream (batches in
its buffer pool or ring, frames libzmq has not written) for as long as the peer stays silent:
24 peers that said Hello and never read held 1.4 GB of a 61 MB dataset. So until a stream's
first Credit (its client consumed a batch), it spends only its *allotment*:

* at most ``stream_bytes`` (``--unread-stream-bytes``) of messages, and at least one
  message, so any batch size still flows;
* all streams that have not read together at most ``total_bytes`` (``--unread-bytes``); a
  stream whose first message does not fit *waits*, Welcomed, with no batch sent, and takes
  its allotment, first come first served, when a stream that has not read reads or closes.
  One message is always allotted when no unread stream holds anything, so one giant batch
  still flows.

The rest of its credit is held back (:meth:`~.pipeline.Pipeline.hold`) and released at its
first Credit, from which on its credit alone bounds it. A stream past the server-wide bound
waits rather than being refused: the bound is held by streams that are about to read (ranks
starting together) or that close, and a refused trainer would only retry its Hello (the
Loader's wait, its ``timeout`` and its ``DataStallError`` are the same either way), while a
waiting one starts the moment room is made, first come first served.

Bytes are counted per message at the stream's batch size (``Prepared.batch_bytes``, the
dataset's average sample for variable-size fields) times the batches of a message. Pure
bookkeeping; the streamer thread owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

#: ``(routing id, stream id)``: one stream.
StreamKey = tuple[bytes, int]

#: Defaults of ``--unread-stream-bytes`` and ``--unread-bytes``.
UNREAD_STREAM_BYTES = 64 << 20
UNREAD_BYTES = 512 << 20


@dataclass(frozen=True)
class Ask:
    """What a stream that has not read would spend: ``messages`` of ``message_bytes``."""

    message_bytes: int
    messages: int


@dataclass
class UnreadBudget:
    """Allotments of the streams that have not read yet (see the module docstring)."""

    stream_bytes: int = UNREAD_STREAM_BYTES
    total_bytes: int = UNREAD_BYTES
    #: Bytes allotted per stream that has not read.
    _held: dict[StreamKey, int] = field(default_factory=dict)
    #: Streams waiting for room, in the order they came, with what they ask.
    _waiting: OrderedDict[StreamKey, Ask] = field(default_factory=OrderedDict)
    used: int = 0

    def ask(self, message_bytes: int, credit: int, group: int) -> Ask:
        """What a stream of ``credit`` batches, ``group`` a message, would spend unread."""
        message_bytes = max(message_bytes, 1)
        wanted = -(-credit // max(group, 1))
        return Ask(message_bytes, max(1, min(wanted, self.stream_bytes // message_bytes)))

    def _room(self, ask: Ask) -> int:
        """Messages of ``ask`` that fit now (one always does when nothing is held)."""
        room = (self.total_bytes - self.used) // ask.message_bytes
        return min(ask.messages, max(room, 0 if self.used else 1))

    def admit(self, key: StreamKey, ask: Ask) -> int:
        """Messages ``key`` may spend now (0: it waits, and :meth:`due` hands them later)."""
        n = self._room(ask) if not self._waiting else 0  # no overtaking those who wait
        if n == 0:
            self._waiting[key] = ask
            return 0
        self._take(key, n * ask.message_bytes)
        return n

    def _take(self, key: StreamKey, nbytes: int) -> None:
        self._held[key] = nbytes
        self.used += nbytes

    def read(self, key: StreamKey) -> bool:
        """``key`` read (or closed): its allotment goes back. Whether it had one or waited."""
        waited = self._waiting.pop(key, None) is not None
        freed = self._held.pop(key, None)
        if freed is not None:
            self.used -= freed
        return waited or freed is not None

    def due(self) -> list[tuple[StreamKey, int]]:
        """Waiting streams that fit now, first come first served, with their messages."""
        out = []
        while self._waiting:
            key, ask = next(iter(self._waiting.items()))
            n = self._room(ask)
            if n == 0:
                break
            del self._waiting[key]
            self._take(key, n * ask.message_bytes)
            out.append((key, n))
        return out

    @property
    def waiting(self) -> int:
        """Streams waiting for room."""
        return len(self._waiting)
