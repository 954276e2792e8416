"""The table of job kinds, keyed by ``JobSpec.kind``: the one place a job's kind is chosen."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from shardserve.proto.jobs import JobKindName, JobSpec

from .base import JobKind, KindParts
from .mixture import MixtureJobs
from .plain import PlainJobs

#: Each kind's class, built once per server from the same :class:`KindParts`.
KINDS: Mapping[JobKindName, Callable[[KindParts], JobKind]] = {
    "dataset": PlainJobs,
    "mixture": MixtureJobs,
}


class JobKinds:
    """The server's object of every kind; :meth:`of` hands a spec's. Thread-safe (built
    once, then only read)."""

    def __init__(self, parts: KindParts) -> None:
        self._kinds = {name: make(parts) for name, make in KINDS.items()}

    def of(self, spec: JobSpec) -> JobKind:
        """The kind of a job of ``spec``; callers hold it and ask it, never the spec."""
        return self._kinds[spec.kind]
