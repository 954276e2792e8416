"""Who holds each slot of an attached shared-memory ring, on the client's side.

A slot is the server's until a batch header names it, then the client's until it goes back in
a ``Credit`` (or, for a new stream on the same ring, is left out of ``Hello.keep``). While the
client has it, the slot is in exactly one state::

    server ──batch in slot──▶ lent (a delivered batch's tensors are the slot)  ─┐
                          ──▶ view (copy=False: valid until the next batch)    ─┤ collect()
                          ──▶ dma  (an async device copy reads it)             ─┤ once free
                          ──▶ returning (copied out, or a duplicate) ◀─────────┘
    returning ──Credit.slots──▶ server          a new Hello: held slots travel in keep,
                                                 every other slot is the server's again

A ``dma`` slot stays held until its copy's event completed, then until no tensor reads it:
handing it back earlier lets the server refill memory the GPU is still reading. Every slot is
returned at most once and none is forgotten while the client holds it (tests/client/test_ledger.py
checks this over random sequences). The ledger knows no sockets and no torch: whether a tensor
still reads a slot is the ``in_use`` callback's answer.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

from shardserve.proto.errors import ProtocolError


class Event(Protocol):
    """What the ledger needs of a ``torch.cuda.Event``."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Hold(enum.Enum):
    """Why the client still holds a slot."""

    LENT = "lent"  # a delivered batch lives in it; back once no tensor uses it
    VIEW = "view"  # copy=False views; back at the next batch, whoever still points into it
    DMA = "dma"  # an async device copy reads it; back once its event completed


class SlotLedger:
    """The client's slots of one ring: held, or on their way back with the next ``Credit``.

    >>> ledger = SlotLedger(slots=4, in_use=lambda slot: False)
    >>> ledger.lend(2); ledger.release(0); ledger.collect(); ledger.returns()
    (0, 2)
    """

    def __init__(self, slots: int, in_use: Callable[[int], bool]) -> None:
        self.slots = slots
        self._in_use = in_use
        # Insertion order is lend order: the oldest device copy is the first DMA entry.
        self._held: dict[int, Hold] = {}
        self._events: dict[int, Event] = {}
        self._returning: list[int] = []

    # -- a batch arrived in a slot ----------------------------------------------------------

    def lend(self, slot: int) -> None:
        """The delivered batch is the slot: held until no tensor uses it."""
        self._take(slot, Hold.LENT)

    def lend_view(self, slot: int) -> None:
        """``copy=False``: held until the next :meth:`collect`, whatever still points into it."""
        self._take(slot, Hold.VIEW)

    def lend_to_copy(self, slot: int, done: Event) -> None:
        """A device copy reads ``slot`` until ``done`` completes."""
        self._take(slot, Hold.DMA)
        self._events[slot] = done

    def release(self, slot: int) -> None:
        """The client is done with ``slot`` already (copied out, or a duplicate batch)."""
        self._check(slot)
        self._returning.append(slot)

    # -- handing slots back -----------------------------------------------------------------

    @property
    def held(self) -> int:
        """Slots the client holds (not counting those on their way back)."""
        return len(self._held)

    @property
    def copies_in_flight(self) -> int:
        """Slots still read by a device copy whose event has not been seen complete."""
        return len(self._events)

    def can_lend(self) -> bool:
        """Whether another batch may stay in its slot: at most half the ring is lent, so the
        server always has a slot to fill (a ring of one is never lent)."""
        return self.held < self.slots // 2

    def collect(self) -> None:
        """Move every slot the client is done with to the returns (called before each batch)."""
        if self._events and self.held >= self.slots:
            # Every slot is held, some by device copies queued behind the consumer's stream:
            # the server has none to fill, so wait for the oldest copy.
            next(iter(self._events.values())).synchronize()
        for slot in [s for s in self._held if not self._holds(s, next_batch=True)]:
            del self._held[slot]
            self._returning.append(slot)

    def returns(self) -> tuple[int, ...]:
        """Slots to hand back with the next ``Credit`` (call :meth:`returned` once it is sent)."""
        return tuple(self._returning)

    def returned(self, slots: tuple[int, ...]) -> None:
        """``slots`` went out in a Credit: they are the server's again."""
        gone = set(slots)
        self._returning = [s for s in self._returning if s not in gone]

    def keep(self) -> tuple[int, ...]:
        """For a new stream's ``Hello``: the slots still held (``copy=False`` views too: the
        loop has not asked for its next batch yet). Every other slot, those on their way back
        included, is the server's again once it resets the ring for the new stream, so the
        ledger forgets them."""
        for slot in [s for s in self._held if not self._holds(s, next_batch=False)]:
            del self._held[slot]
        self._returning = []
        return tuple(sorted(self._held))

    def clear(self) -> None:
        """The ring is unmapped: nothing is held any more."""
        self._held.clear()
        self._events.clear()
        self._returning = []

    # -- internals --------------------------------------------------------------------------

    def _holds(self, slot: int, next_batch: bool) -> bool:
        """Whether the client still needs ``slot``; views last until the next batch."""
        if self._held[slot] is Hold.VIEW:
            return not next_batch
        done = self._events.get(slot)
        if done is not None:
            if not done.query():
                return True
            del self._events[slot]
        return self._in_use(slot)

    def _take(self, slot: int, state: Hold) -> None:
        self._check(slot)
        self._held[slot] = state

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ProtocolError(f"slot {slot} out of range 0 <= slot < {self.slots}")
        if slot in self._held or slot in self._returning:
            state = self._held[slot].value if slot in self._held else "on its way back"
            raise ProtocolError(
                f"the server filled slot {slot}, which this client still holds ({state})"
            )
