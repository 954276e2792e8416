"""The pure stream pipeline: credit, what to assemble next, inline or pool, in-order release."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.proto.messages import MAX_CREDIT
from shardserve.server.streaming.pipeline import (
    INLINE_BACKOFF,
    INLINE_MAX_BYTES,
    INLINE_MAX_S,
    MAX_INFLIGHT_PER_STREAM,
    CreditOverflow,
    Pipeline,
)

# One step of a random run: grant credit, take work (inline or to the pool), finish one
# pooled batch, or release what is in order.
step = st.one_of(
    st.tuples(st.just("grant"), st.integers(1, 300)),
    st.tuples(st.just("take"), st.booleans()),
    st.tuples(st.just("finish"), st.integers(0, 1000)),
    st.tuples(st.just("release"), st.integers(1, 5)),
)


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(0, 20),
    num=st.integers(0, 200),
    initial=st.integers(1, MAX_CREDIT),
    steps=st.lists(step, max_size=200),
)
def test_credit_is_never_exceeded_and_batches_leave_in_order(
    start: int, num: int, initial: int, steps: list[tuple[str, object]]
) -> None:
    """Whatever the order of credits, takes and completions, the stream never holds more
    than the client granted (nor MAX_CREDIT), and releases exactly start, start+1, ..."""
    start = min(start, num)
    flow: Pipeline[int] = Pipeline(start, num, initial)
    granted, released, pooled = initial, [], []
    for kind, arg in steps:
        if kind == "grant":
            assert isinstance(arg, int)
            before = flow.owed
            if before + arg > MAX_CREDIT:
                with pytest.raises(CreditOverflow):
                    flow.grant(arg)
                assert flow.owed == before  # refused: nothing changed
            else:
                flow.grant(arg)
                granted += arg
        elif kind == "take" and flow.wants_work():
            index = flow.take()[0]
            if arg:  # assembled inline: ready at once
                flow.assembled(index, index * 10)
            else:
                flow.offloaded()
                pooled.append(index)
        elif kind == "finish" and pooled:
            assert isinstance(arg, int)
            index = pooled.pop(arg % len(pooled))  # results come back in any order
            flow.returned()
            flow.assembled(index, index * 10)
        elif kind == "release":
            assert isinstance(arg, int)
            for _ in range(arg):
                batch = flow.next_ready()
                if batch is None:
                    break
                index = flow.released()
                assert batch == index * 10
                released.append(index)
        # Invariants after every step.
        assert 0 <= flow.owed <= MAX_CREDIT
        assert flow.next_submit - start <= granted  # never assembled past the credit given
        assert len(released) + flow.owed <= granted
        assert flow.credit >= 0 and flow.in_flight >= 0
        assert 0 <= flow.assembling <= MAX_INFLIGHT_PER_STREAM
        assert flow.next_submit <= num
    assert released == list(range(start, start + len(released)))


def test_take_refuses_without_credit_and_past_the_end() -> None:
    """No credit, or no batches left: there is no next work, and taking anyway raises."""
    flow: Pipeline[str] = Pipeline(0, 2, 1)
    assert flow.take()[0] == 0
    assert not flow.wants_work()  # credit spent
    with pytest.raises(RuntimeError, match="credit 0"):
        flow.take()[0]
    flow.grant(5)
    assert flow.take()[0] == 1
    assert not flow.wants_work()  # both batches taken
    assert flow.owed == 1 + 5  # everything granted: 2 in flight, 4 unused


def test_pool_work_is_capped_per_stream() -> None:
    """A stream keeps at most MAX_INFLIGHT_PER_STREAM batches on the pool at once."""
    flow: Pipeline[str] = Pipeline(0, 100, 50)
    for _ in range(MAX_INFLIGHT_PER_STREAM):
        flow.take()[0]
        flow.offloaded()
    assert not flow.wants_work()
    flow.returned()
    assert flow.wants_work()


def test_release_waits_for_the_next_index() -> None:
    """A later batch that finished first is held until every earlier one is released."""
    flow: Pipeline[str] = Pipeline(3, 10, 3)
    a, b, c = flow.take()[0], flow.take()[0], flow.take()[0]
    flow.assembled(c, "c")
    flow.assembled(b, "b")
    assert flow.next_ready() is None
    flow.assembled(a, "a")
    out = []
    while (x := flow.next_ready()) is not None:
        flow.released()
        out.append(x)
    assert out == ["a", "b", "c"] and flow.next_send == 6
    assert flow.drain() == []


def test_drain_returns_what_will_never_be_sent() -> None:
    """Closing a stream hands back every assembled, unsent batch (their memory is freed)."""
    flow: Pipeline[str] = Pipeline(0, 10, 3)
    for _ in range(3):
        i = flow.take()[0]
        flow.assembled(i, f"b{i}")
    flow.released()
    assert sorted(flow.drain()) == ["b1", "b2"] and not flow.ready


def test_inline_only_for_small_batches_of_a_lone_stream() -> None:
    """Small batches of a lone stream are gathered inline; big ones, or with others busy, not."""
    flow: Pipeline[str] = Pipeline(0, 1000, 10)
    assert flow.inline(INLINE_MAX_BYTES, others_busy=False)
    assert not flow.inline(INLINE_MAX_BYTES + 1, others_busy=False)
    assert not flow.inline(1024, others_busy=True)


def test_a_slow_inline_gather_sends_the_next_batches_to_the_pool() -> None:
    """After an inline gather slower than INLINE_MAX_S, the next INLINE_BACKOFF batches use the
    pool; a fast one changes nothing."""
    flow: Pipeline[str] = Pipeline(0, 1000, 1000)
    i = flow.take()[0]
    flow.timed_inline(i, INLINE_MAX_S / 2)
    assert flow.inline(1024, others_busy=False)
    flow.timed_inline(i, INLINE_MAX_S * 2)
    for _ in range(INLINE_BACKOFF - 1):
        assert not flow.inline(1024, others_busy=False)
        flow.take()[0]
    assert flow.next_submit == INLINE_BACKOFF
    assert flow.inline(1024, others_busy=False)
