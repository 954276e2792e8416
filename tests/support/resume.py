"""``assert_resumes_exactly``: the one check every resumable iterator in shardserve passes.

A resumable thing is given to the helper as ``make_iter(state) -> (iterator, get_state)``:
``make_iter(None)`` starts fresh, ``make_iter(state)`` starts from a state returned by
``get_state()``. The state is taken where ``next()`` returns, so it counts what the consumer
*received*, not what a prefetcher read ahead::

    def make_iter(state):
        loader = Loader(url, "cifar", 64, rank=0, world_size=1)
        if state is not None:
            loader.load_state_dict(state)
        return iter(loader), loader.state_dict

    assert_resumes_exactly(make_iter, midpoint=5, key=lambda b: tuple(b["label"].tolist()))
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterator
from typing import Any

MakeIter = Callable[[Any], tuple[Iterator[Any], Callable[[], Any]]]


def _take(it: Iterator[Any], n: int, key: Callable[[Any], Hashable]) -> list[Hashable]:
    out = []
    for i in range(n):
        try:
            out.append(key(next(it)))
        except StopIteration:
            raise AssertionError(
                f"iterator ended after {i} items, before the midpoint {n}"
            ) from None
    return out


def assert_resumes_exactly(
    make_iter: MakeIter, midpoint: int, key: Callable[[Any], Hashable] = lambda x: x
) -> None:
    """Stopping after ``midpoint`` items and resuming from the state yields exactly the rest.

    Checks: (1) a fresh run is the reference; (2) taking a state does not disturb the run it
    was taken from; (3) a new iterator built from the state yields the reference's items
    ``midpoint:`` — no more, no fewer, same order; (4) the state survives a JSON round trip,
    so it can go into a checkpoint.
    """
    it, _ = make_iter(None)
    reference = [key(x) for x in it]
    assert 0 <= midpoint <= len(reference), f"midpoint {midpoint} out of range 0..{len(reference)}"

    it, get_state = make_iter(None)
    head = _take(it, midpoint, key)
    state = json.loads(json.dumps(get_state()))
    tail = [key(x) for x in it]
    assert head + tail == reference, "taking a state changed the run it was taken from"

    resumed, _ = make_iter(state)
    rest = [key(x) for x in resumed]
    assert len(rest) == len(reference) - midpoint, (
        f"resumed at {midpoint} of {len(reference)}: got {len(rest)} items, expected {len(reference) - midpoint}"
    )
    for i, (got, want) in enumerate(zip(rest, reference[midpoint:], strict=True)):
        assert got == want, f"item {midpoint + i} differs after resume: {got!r} != {want!r}"
