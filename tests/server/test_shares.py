"""A share group's window as pure bookkeeping: who assembles a span, who is handed it, who
goes on on its own pass; and the grid that makes every member take the same spans."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.server.streaming.pipeline import Pipeline
from shardserve.server.streaming.shares import ShareBook, ShareGroup, Take, Waiter

KEY = ("job", 0, 0, 0, 0, 4)


def span_at(index: int, grid: int, num: int) -> int:
    return min(grid - index % grid, num - index)


@settings(max_examples=300, deadline=None)
@given(
    starts=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    window=st.integers(1, 24),
    grid=st.integers(1, 6),
    steps=st.lists(st.tuples(st.integers(0, 4), st.booleans()), max_size=300),
)
def test_each_span_is_assembled_once_for_the_group_and_memory_stays_in_the_window(
    starts: list[int], window: int, grid: int, steps: list[tuple[int, bool]]
) -> None:
    """Members at any speeds: a span inside the window is assembled by one member and
    handed to the others; below the window, only for members that will take it soon; a
    member alone below the window goes on its own; at most two windows of batches are kept
    (below the front, and below it for members behind)."""
    num = 60
    window = max(window, 2 * grid)
    g = ShareGroup(("job", 0, 0, 0, 0, grid), window, "s")
    nxt = {bytes([m]): s for m, s in enumerate(starts)}
    for ident, s in nxt.items():
        g.join(ident, 1, s)
    pending: list[int] = []
    front = 0
    produced: dict[int, int] = {}  # first index -> times assembled for the group
    for who, finish in steps:
        if finish and pending:
            index = pending.pop(0)
            parts = {"x": np.arange(index, index + 2)}
            g.produced(index, parts)
            produced[index] = produced.get(index, 0) + 1
            continue
        ident = bytes([who % len(starts)])
        index = nxt[ident]
        if index >= num:
            continue
        count = span_at(index, grid, num)
        take, entry, _ = g.take(ident, index, count)
        nxt[ident] = index + count
        front = max(front, index + count)
        if take is Take.OWN:
            assert index < g.low or (index in g.entries and g.entries[index].count != count)
            continue
        assert (
            index >= g.low
            or take is not Take.PRODUCE
            or any(n <= index < n + window for other, n in nxt.items() if other != ident)
        ), "a span below the window kept for nobody"
        assert entry is not None and entry.count == count and g.entries[index] is entry
        if take is Take.READY:
            assert entry.parts is not None and int(entry.parts["x"][0]) == index
        elif take is Take.PRODUCE:
            pending.append(index)
        assert g.kept <= 2 * window + grid
    assert all(n == 1 for n in produced.values()), produced
    assert g.front == front


def test_a_member_behind_the_window_is_detached_once_and_rejoins_when_it_catches_up() -> None:
    g = ShareGroup(KEY, 8, "s")
    g.join(b"fast", 1, 0)
    g.join(b"slow", 2, 0)
    for i in range(0, 20, 4):
        take, _, _ = g.take(b"fast", i, 4)
        assert take is Take.PRODUCE
        g.produced(i, {"x": np.zeros(1)})
    # Below the window, the spans the slow member will take within a window are kept.
    assert g.low == 12 and sorted(g.entries) == [0, 4, 12, 16]
    assert g.take(b"slow", 0, 4)[::2] == (Take.READY, False)
    for i in range(20, 40, 4):  # the fast one goes on; the slow one falls behind
        g.take(b"fast", i, 4)
        g.produced(i, {"x": np.zeros(1)})
    assert g.low == 32 and sorted(g.entries) == [4, 32, 36]
    assert g.take(b"slow", 4, 4)[::2] == (Take.READY, False)
    assert g.take(b"slow", 8, 4)[::2] == (Take.OWN, True)
    assert g.take(b"slow", 12, 4)[::2] == (Take.OWN, False)  # told once
    for i in range(16, 32, 4):
        g.take(b"slow", i, 4)
    take, entry, _ = g.take(b"slow", 32, 4)  # back in the window
    assert take is Take.READY and entry is g.entries[32]
    assert g.detaches == 1 and not g.members[b"slow"].detached
    assert g.lags() == [0, 4]


def test_members_behind_the_window_share_among_themselves() -> None:
    """Three trials started together after a first one that is far ahead: one of them
    assembles each span, the other two are handed it; none is detached."""
    g = ShareGroup(KEY, 8, "s")
    g.join(b"first", 1, 0)
    for i in range(0, 200, 4):
        assert g.take(b"first", i, 4)[0] is Take.PRODUCE
        g.produced(i, {"x": np.full(1, i)})
    for m in (b"a", b"b", b"c"):
        g.join(m, 2, 0)
    for i in range(0, 40, 4):
        takes = [g.take(m, i, 4) for m in (b"a", b"b", b"c")]
        assert [t[0] for t in takes] == [Take.PRODUCE, Take.WAIT, Take.WAIT], i
        g.produced(i, {"x": np.full(1, i)})
    assert g.detaches == 0 and g.assembled == 200 + 40  # batches: each span once
    assert g.kept <= 2 * g.window
    lone = ShareGroup(KEY, 8, "s")  # one trial alone behind: its own pass, told once
    lone.join(b"first", 1, 0)
    lone.join(b"late", 2, 0)
    for i in range(0, 40, 4):
        lone.take(b"first", i, 4)
        lone.produced(i, {"x": np.full(1, i)})
    got = [lone.take(b"late", i, 4)[::2] for i in range(0, 20, 4)]
    assert got == [(Take.READY, False)] * 2 + [(Take.OWN, True)] + [(Take.OWN, False)] * 2


def test_a_group_outlives_its_last_member_briefly_and_a_newer_stream_is_not_dropped() -> None:
    book = ShareBook(window=64, window_bytes=1 << 30, keep_s=10.0, max_idle=1)
    book.join(KEY, "s", b"a", 1, 0, 1000)
    book.join(KEY, "s", b"b", 2, 0, 1000)
    assert book.spans_of(KEY[:5]) == 4
    book.join(KEY, "s", b"a", 3, 5, 1000)  # a's next stream (a resume) replaces its first
    book.leave(b"a", 1)  # the first one's close comes late: a's newer stream stays
    assert set(book.get(KEY).members) == {b"a", b"b"}  # type: ignore[union-attr]
    book.leave(b"a", 3, now=100.0)
    book.leave(b"b", now=100.0)
    g = book.get(KEY)
    assert g is not None and not g.members  # kept for a joiner that comes soon
    book.expire(109.0)
    assert book.get(KEY) is g
    book.join(KEY, "s", b"c", 4, 0, 1000)  # found where the group left it
    assert book.get(KEY) is g
    book.leave(b"c", now=200.0)
    book.expire(210.0)
    assert book.get(KEY) is None and book.spans_of(KEY[:5]) is None
    other = ("job", 1, 0, 0, 0, 4)
    book.join(KEY, "s", b"d", 5, 0, 1000)
    book.join(other, "s", b"e", 6, 0, 1000)
    book.leave(b"d", now=300.0)
    book.leave(b"e", now=301.0)  # a second idle group: the older one goes (max_idle=1)
    assert book.get(KEY) is None and book.get(other) is not None


def test_the_window_is_bounded_by_bytes_but_holds_two_messages() -> None:
    book = ShareBook(window=64, window_bytes=100 << 20)
    assert book.window_for(1 << 20, 4) == 64
    assert book.window_for(10 << 20, 4) == 10
    assert book.window_for(80 << 20, 4) == 8


@given(start=st.integers(0, 50), grid=st.integers(1, 8), num=st.integers(1, 80))
def test_a_grid_makes_spans_end_on_its_multiples(start: int, grid: int, num: int) -> None:
    """Members that start anywhere take the same spans after their first one, and a span is
    taken only with the credit for all of it."""
    flow: Pipeline[object] = Pipeline(min(start, num), num, credit=2 * grid)
    flow.grid = grid
    while flow.wants_work():
        index, count = flow.take(grid)
        end = index + count
        assert end == num or end % grid == 0
        assert count == min(grid - index % grid, num - index)
        flow.assembled(index, object())
        flow.released()
        flow.grant(count)
    assert flow.next_submit == num


def test_every_groups_window_stays_within_the_servers_budget() -> None:
    """Spans past ``--share-bytes`` (all groups together) are handed to their waiters and not
    kept; dropped groups give their bytes back."""
    book = ShareBook(window=64, window_bytes=1 << 30, keep_s=0.0, total_bytes=3000)
    one, two = KEY, ("job", 1, 0, 0, 0, 4)
    g1 = book.join(one, "s", b"a", 1, 0, 1000)
    g2 = book.join(two, "s", b"b", 2, 0, 1000)
    kilo = {"x": np.zeros(1000, np.uint8)}
    for g, ident in ((g1, b"a"), (g2, b"b"), (g1, b"a"), (g2, b"b")):
        index = g.front
        take, entry, _ = g.take(ident, index, 4)
        assert take is Take.PRODUCE and entry is not None
        entry.waiters.append(Waiter(ident, 1, 0, None))  # type: ignore[arg-type]
        assert len(g.produced(index, kilo)) == 1  # its waiter is handed it either way
    assert book.budget.used == 3000  # the fourth span was not kept
    assert sorted(g1.entries) == [0, 4] and sorted(g2.entries) == [0]
    book.leave(b"a", now=0.0)
    book.expire(1.0)
    assert book.get(one) is None and book.budget.used == 1000
