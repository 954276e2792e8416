"""Messages an HTTP thread sends a streaming process and waits to see confirmed.

A placed rank (:class:`AdmitStream`) and a changed job (:class:`UpdateJob`) are confirmed by
the process's :class:`Ack`; the main process's link thread delivers them and releases the
waiter, at once and as failed when the process could not take the message (not ready).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shardserve.proto.processes import ADMIT_TIMEOUT_S, AdmitStream, LinkMessage, UpdateJob

from ..runtime.logs import log_event

log = logging.getLogger("shardserve.processes")

#: ``send(process, message)``: queue a message for the link thread to deliver.
Send = Callable[[int, LinkMessage], None]
Asked = AdmitStream | UpdateJob


@dataclass(eq=False)
class Ask:
    """One wait for a process's Ack; ``ok`` is False when the message was not delivered."""

    process: int
    message: Asked
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = True


class Asks:
    """The asks under way, by request id: ``post`` on an HTTP thread, then ``acked`` to
    wait; ``ack`` and ``undelivered`` on the link thread."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, Ask] = {}

    def post(self, k: int, make: Callable[[int], Asked]) -> Ask:
        """Queue the message ``make(request id)`` for process ``k``, to be waited on."""
        ask = Ask(k, make(next(self._ids)))
        with self._lock:
            self._waiting[ask.message.request] = ask
        self._send(k, ask.message)
        return ask

    def acked(self, asks: list[Ask]) -> bool:
        """Wait for every ask's Ack against one deadline of :data:`ADMIT_TIMEOUT_S`; whether
        all came. One that did not is logged, naming its process."""
        deadline = time.monotonic() + ADMIT_TIMEOUT_S
        all_ok = True
        for ask in asks:
            acked = ask.done.wait(max(0.0, deadline - time.monotonic())) and ask.ok
            with self._lock:
                self._waiting.pop(ask.message.request, None)
            if not acked:
                all_ok = False
                log_event(
                    log,
                    "processes.not_ready" if ask.done.is_set() else "processes.ack_timeout",
                    level=logging.WARNING,
                    process=ask.process,
                    job=ask.message.job.id,
                    waited_s=ADMIT_TIMEOUT_S,
                    kind=ask.message.kind,
                )
        return all_ok

    def ack(self, request: int) -> None:
        """The process confirmed ``request`` (the link thread)."""
        self._release(request, ok=True)

    def undelivered(self, message: Asked) -> None:
        """``message`` could not be delivered (the link thread): its waiter fails now."""
        self._release(message.request, ok=False)

    def _release(self, request: int, ok: bool) -> None:
        with self._lock:
            ask = self._waiting.get(request)
        if ask is not None:
            ask.ok = ok
            ask.done.set()
