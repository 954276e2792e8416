"""A job's lifecycle state, decided from its record and what its streams do.

::

    created --> pending --(a rank opens a stream)--> running --(no stream for idle_after_s)--+
                   |                                    ^                                     |
                   +--(no stream for idle_after_s)--+   +---------(a rank comes back)---------+
                                                    v                                         v
                                                  idle   <- an epoch left unfinished ->   finished
                                                    |                                         |
                                                    +-----(no stream for job_ttl_s)-----------+--> expired (forgotten)

    any state --(corrupt data, ...)--> failed (expires like idle; kept in memory only)

``running`` lasts ``idle_after_s`` past the last stream so that the gap between two epochs,
or a trainer's evaluation loop, does not flap the state (and the job's metric series). A job
replayed from the journal at start is ``idle`` until one of its ranks comes back. ``pending``
and ``running`` jobs are *live*: they count against the job cap; the others may be evicted to
make room and are expired after ``job_ttl_s``.
"""

from __future__ import annotations

from shardserve.proto.api import JobState

from ..registry.jobs import Job
from ..streaming.board import JobActivity

#: States that count against the cap and keep their metric series.
LIVE: frozenset[JobState] = frozenset({"pending", "running"})
#: States whose per-job metric series are dropped (the job's work is over).
ENDED: frozenset[JobState] = frozenset({"finished", "failed"})


def last_active(job: Job, activity: JobActivity | None) -> float:
    """``time.monotonic()`` of the job's last sign of use."""
    return max(job.touched, activity.last_active if activity is not None else 0.0)


def job_state(job: Job, activity: JobActivity | None, now: float, idle_after_s: float) -> JobState:
    """The state to report for ``job`` at monotonic time ``now``."""
    if job.state == "failed":
        return "failed"
    if activity is not None and activity.connected:
        return "running"
    quiet = now - last_active(job, activity) >= idle_after_s
    if activity is None:  # no stream since this server started
        return "idle" if job.restored or quiet else "pending"
    if not quiet:
        return "running"
    if activity.complete and activity.ranks_seen >= job.spec.world_size:
        return "finished"
    return "idle"


def expired(job: Job, activity: JobActivity | None, now: float, ttl_s: float) -> bool:
    """Whether a job that is not live has gone ``ttl_s`` without a stream (0: never)."""
    return ttl_s > 0 and now - last_active(job, activity) >= ttl_s
