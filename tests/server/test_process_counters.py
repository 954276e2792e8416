"""The counters of a server with streaming processes: a dead process's counts are kept, its
gauges are not, and nothing counted twice."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from shardserve.server.processes.counters import Totals, families_of


def _process(batches: float, streams: float) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    Counter("t_batches", "batches sent", ["job"], registry=reg).labels(job="a").inc(batches)
    Gauge("t_streams", "streams open", registry=reg).set(streams)
    return reg


def _values(text: bytes) -> dict[str, float]:
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text.decode())
        for s in f.samples
        if not s.name.endswith("_created")
    }


def test_a_dead_process_keeps_its_counts_and_drops_its_gauges() -> None:
    """Two processes died one after the other: their batches stay in the sum, their streams do not."""
    main, live = _process(1, 1), _process(10, 2)
    totals = Totals()
    totals.fold(families_of(_process(100, 3)))
    totals.fold(families_of(_process(1000, 4)))
    got = _values(totals.render(main, [families_of(live)]))
    assert got == {"t_batches_total": 1111.0, "t_streams": 3.0}


def test_the_earliest_created_time_is_kept() -> None:
    """A series' created time is the first process's, not a sum of them."""
    old, new = _process(1, 0), _process(1, 0)
    totals = Totals()
    totals.fold(families_of(old))
    created = [
        s.value
        for f in text_string_to_metric_families(totals.render(new, []).decode())
        for s in f.samples
        if s.name == "t_batches_created"
    ]
    first = [s.value for s in families_of(old)[0].samples if s.name == "t_batches_created"]
    assert created == first
