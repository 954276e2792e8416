"""``/metrics`` of a server with streaming processes: each process's families summed.

A streaming process sends its families with its reports (:func:`families_of`); the main
process renders its own plus every live process's, and the counters of processes that died
(:class:`Totals`), so that no counter goes down when a process is replaced. Gauges are summed
over live processes only (a dead process holds no stream, no ring, no byte). The metric names
stay stated once, in :mod:`..runtime.metrics`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from shardserve.proto.processes import Family, Sample

#: Family types whose samples only grow (folded into the base when their process dies).
CUMULATIVE = frozenset({"counter", "histogram", "summary"})
#: A sample saying when its series began: the earliest one is kept, never a sum.
CREATED_SUFFIX = "_created"

_Key = tuple[str, tuple[tuple[str, str], ...]]


def families_of(registry: CollectorRegistry) -> list[Family]:
    """Every family of ``registry`` as it is now."""
    return [
        Family(
            name=m.name,
            type=m.type,
            documentation=m.documentation,
            samples=[Sample(name=s.name, labels=dict(s.labels), value=s.value) for s in m.samples],
        )
        for m in registry.collect()
    ]


def _key(s: Sample) -> _Key:
    return s.name, tuple(sorted(s.labels.items()))


class _Merged:
    """Families by name, samples by name and labels, in the order first seen."""

    def __init__(self) -> None:
        self.heads: dict[str, Family] = {}
        self.values: dict[str, dict[_Key, float]] = {}

    def add(self, families: Iterable[Family], cumulative_only: bool = False) -> None:
        for f in families:
            if cumulative_only and f.type not in CUMULATIVE:
                continue
            self.heads.setdefault(f.name, f)
            into = self.values.setdefault(f.name, {})
            for s in f.samples:
                k = _key(s)
                if s.name.endswith(CREATED_SUFFIX):
                    into[k] = min(into.get(k, s.value), s.value)
                else:
                    into[k] = into.get(k, 0.0) + s.value

    def families(self) -> list[Family]:
        return [
            Family(
                name=name,
                type=head.type,
                documentation=head.documentation,
                samples=[
                    Sample(name=n, labels=dict(labels), value=v)
                    for (n, labels), v in self.values[name].items()
                ],
            )
            for name, head in self.heads.items()
        ]


class Totals:
    """What the processes that died had counted (their last report's cumulative families)."""

    def __init__(self) -> None:
        self._base: list[Family] = []

    def fold(self, families: list[Family]) -> None:
        """Keep a dead process's counters for good."""
        merged = _Merged()
        merged.add(self._base)
        merged.add(families, cumulative_only=True)
        self._base = merged.families()

    def render(self, own: CollectorRegistry, live: Iterable[list[Family]]) -> bytes:
        """The text exposition of ``own`` plus every live process's families and the base."""
        merged = _Merged()
        merged.add(families_of(own))
        for families in live:
            merged.add(families)
        merged.add(self._base)
        out = CollectorRegistry(auto_describe=False)
        out.register(_Fixed(merged.families()))
        return generate_latest(out)


class _Fixed:
    """A collector that yields families already collected."""

    def __init__(self, families: list[Family]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for f in self._families:
            m = Metric(f.name, f.documentation, f.type)
            for s in f.samples:
                m.add_sample(s.name, s.labels, s.value)
            yield m
