"""How much slower than an idle machine this one runs right now: a factor for the few test
deadlines that cannot be an awaited event (a server-side timeout a test sets on purpose, a
heartbeat window, a readiness wait).

The factor is measured, not guessed: a short busy loop is timed on the wall clock and on this
process's CPU clock. On an idle core the two agree (factor 1); with other work sharing the
cores the loop gets a fraction of a core and the wall clock runs ahead by the same ratio. It is
clamped to [1, 8] and remeasured at most every few seconds; ``SHARDSERVE_TEST_SLOWNESS``
fixes it (e.g. ``4`` on a machine known to be busy).

>>> from tests.support.slowness import scaled
>>> scaled(3.0) >= 3.0
True
"""

from __future__ import annotations

import os
import time

ENV = "SHARDSERVE_TEST_SLOWNESS"
_SAMPLE_S = 0.1
_MAX = 8.0
_REMEASURE_S = 5.0
_last: tuple[float, float] | None = None  # (when, factor)


def measure(sample_s: float = _SAMPLE_S) -> float:
    """Wall time / CPU time of a busy loop of ``sample_s`` wall seconds, clamped to [1, 8]."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall0 < sample_s:
        sum(range(2000))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return min(_MAX, max(1.0, wall / max(cpu, 1e-6)))


def slowness() -> float:
    """This machine's current slowness factor (see the module docstring)."""
    global _last
    fixed = os.environ.get(ENV)
    if fixed:
        return max(1.0, float(fixed))
    now = time.monotonic()
    if _last is None or now - _last[0] > _REMEASURE_S:
        _last = (now, measure())
    return _last[1]


def scaled(seconds: float) -> float:
    """``seconds`` stretched by :func:`slowness`, rounded to 0.1 s (so it prints as given)."""
    return round(seconds * slowness(), 1)
