"""The client's slot ledger on its own (no server, no ring): who holds which shared-memory
slot, and which go back with the next Credit or stay in Hello.keep."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shardserve.client._ledger import SlotLedger
from shardserve.proto.errors import ProtocolError


class _Copy:
    """Stands in for the ``torch.cuda.Event`` recorded after a device copy."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def _ledger(slots: int, alive: set[int]) -> SlotLedger:
    return SlotLedger(slots, in_use=lambda slot: slot in alive)


def test_a_lent_slot_goes_back_once_its_batch_is_dropped() -> None:
    """A lent slot stays out of the returns while a tensor reads it, and goes back once."""
    alive = {1}
    ledger = _ledger(4, alive)
    ledger.lend(1)
    ledger.collect()
    assert ledger.returns() == () and ledger.held == 1
    alive.clear()
    ledger.collect()
    assert ledger.returns() == (1,) and ledger.held == 0
    ledger.returned((1,))
    ledger.collect()
    assert ledger.returns() == ()


def test_a_view_goes_back_at_the_next_batch_whatever_points_into_it() -> None:
    """copy=False: the slot goes back at the next collect even while its views live."""
    ledger = _ledger(4, alive={2})
    ledger.lend_view(2)
    assert ledger.keep() == (2,)  # a new stream before the next batch must not refill it
    ledger.lend_view(3)
    ledger.collect()
    assert ledger.returns() == (2, 3)


def test_a_slot_read_by_a_device_copy_stays_held_until_its_event() -> None:
    """The GPU bug: a slot still read by an async copy is neither returned nor left out of
    Hello.keep; once the copy's event completed (and no tensor reads it) it goes back."""
    ledger = _ledger(4, alive=set())
    copy = _Copy()
    ledger.lend_to_copy(0, copy)
    ledger.collect()
    assert ledger.returns() == () and ledger.copies_in_flight == 1
    assert ledger.keep() == (0,)  # across streams too
    copy.done = True
    ledger.collect()
    assert ledger.returns() == (0,) and ledger.copies_in_flight == 0


def test_with_every_slot_held_it_waits_for_the_oldest_copy() -> None:
    """A ring entirely held, partly by queued device copies: collect waits for the oldest copy
    (and only that one) so the server gets a slot to fill."""
    ledger = _ledger(3, alive=set())
    copies = [_Copy() for _ in range(3)]
    for slot, c in enumerate(copies):
        ledger.lend_to_copy(slot, c)
    ledger.collect()
    assert [c.waited for c in copies] == [1, 0, 0]
    assert ledger.returns() == (0,)


def test_at_most_half_the_ring_is_lent() -> None:
    """Lending stops at half the ring, and a ring of one slot is never lent."""
    ledger = _ledger(4, alive={0, 1})
    assert ledger.can_lend()
    ledger.lend(0)
    ledger.lend(1)
    assert not ledger.can_lend()
    assert not _ledger(1, set()).can_lend()


def test_a_new_hello_forgets_the_returns_and_keeps_what_is_held() -> None:
    """keep() names the held slots; those on their way back are the server's again."""
    ledger = _ledger(6, alive={4})
    ledger.lend(4)
    ledger.lend(5)  # its batch is already gone
    ledger.release(1)
    assert ledger.keep() == (4,)
    assert ledger.returns() == ()


def test_a_slot_the_client_holds_cannot_be_filled_again() -> None:
    """The server naming a slot the client holds, or one out of range, is a ProtocolError."""
    ledger = _ledger(2, alive={0})
    ledger.lend(0)
    with pytest.raises(ProtocolError, match="slot 0, which this client still holds"):
        ledger.lend(0)
    ledger.release(1)
    with pytest.raises(ProtocolError, match="on its way back"):
        ledger.lend_view(1)
    with pytest.raises(ProtocolError, match="out of range 0 <= slot < 2"):
        ledger.release(2)


MODES = ("lend", "view", "dma", "release")


class LedgerAgainstAServer(RuleBasedStateMachine):
    """A server that lends free slots and takes back what Credits and Hellos give it, and a
    consumer that holds, drops and copies at random: no slot is ever returned twice, none is
    returned (or left out of keep) while still read, and none is lost."""

    SLOTS = 6

    def __init__(self) -> None:
        super().__init__()
        self.alive: set[int] = set()  # slots a tensor of the consumer still reads
        self.copies: dict[int, _Copy] = {}  # slots an unfinished device copy reads
        self.ledger = SlotLedger(self.SLOTS, in_use=lambda s: s in self.alive)
        self.server_lent: set[int] = set()  # the server's view: slots the client has
        self.views: set[int] = set()

    def _free(self) -> list[int]:
        return [s for s in range(self.SLOTS) if s not in self.server_lent]

    @precondition(lambda self: len(self.server_lent) < self.SLOTS)
    @rule(data=st.data(), mode=st.sampled_from(MODES))
    def deliver(self, data: st.DataObject, mode: str) -> None:
        slot = data.draw(st.sampled_from(self._free()))
        self.server_lent.add(slot)
        if mode == "lend":
            self.alive.add(slot)
            self.ledger.lend(slot)
        elif mode == "view":
            self.alive.add(slot)
            self.views.add(slot)
            self.ledger.lend_view(slot)
        elif mode == "dma":
            self.copies[slot] = _Copy()
            self.ledger.lend_to_copy(slot, self.copies[slot])
        else:
            self.ledger.release(slot)

    @precondition(lambda self: bool(self.alive - self.views))
    @rule(data=st.data())
    def drop_batch(self, data: st.DataObject) -> None:
        self.alive.discard(data.draw(st.sampled_from(sorted(self.alive - self.views))))

    @precondition(lambda self: any(not c.done for c in self.copies.values()))
    @rule(data=st.data())
    def copy_completes(self, data: st.DataObject) -> None:
        pending = sorted(s for s, c in self.copies.items() if not c.done)
        self.copies[data.draw(st.sampled_from(pending))].done = True

    @rule()
    def next_batch(self) -> None:
        # copy=False views are valid until the next batch: from here on nothing reads them.
        self.alive -= self.views
        self.views.clear()
        self.ledger.collect()

    @rule(sent=st.booleans())
    def credit(self, sent: bool) -> None:
        returns = self.ledger.returns()
        assert len(set(returns)) == len(returns), f"slot returned twice in one Credit: {returns}"
        if not sent:
            return  # libzmq's queue was full: the same slots go in the next Credit
        for slot in returns:
            assert slot in self.server_lent, f"slot {slot} returned twice"
            assert slot not in self.alive, f"slot {slot} returned while a tensor reads it"
            copy = self.copies.get(slot)
            assert copy is None or copy.done, f"slot {slot} returned while a copy reads it"
            self.server_lent.discard(slot)
            self.copies.pop(slot, None)
        self.ledger.returned(returns)

    @rule()
    def new_stream(self) -> None:
        keep = set(self.ledger.keep())
        still_read = (self.alive - self.views) | {s for s, c in self.copies.items() if not c.done}
        assert still_read <= keep, f"slots {still_read - keep} left out of keep while read"
        assert keep <= self.server_lent
        self.server_lent = keep | self.views  # a view is kept until the next batch too
        self.copies = {s: c for s, c in self.copies.items() if s in keep}

    @invariant()
    def nothing_lost(self) -> None:
        # Every slot the server thinks the client has is one the ledger holds or returns.
        accounted = self.ledger.held + len(self.ledger.returns())
        assert accounted == len(self.server_lent), (accounted, sorted(self.server_lent))

    def teardown(self) -> None:
        # Everything dropped and copied: after one batch and one Credit the server has all.
        self.alive.clear()
        self.views.clear()
        for c in self.copies.values():
            c.done = True
        self.next_batch()
        self.credit(sent=True)
        assert self.server_lent == set(), f"slots never returned: {sorted(self.server_lent)}"


TestLedgerAgainstAServer = LedgerAgainstAServer.TestCase
TestLedgerAgainstAServer.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
