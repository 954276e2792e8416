"""Prometheus metrics of one server, registered in an injected ``CollectorRegistry``.

Never the global registry: tests (and benchmarks) build several servers in one process, and
each must count only its own work. ``GET /metrics`` renders :meth:`Metrics.render`.

Named by Prometheus' conventions: counters end in ``_total`` and only grow, so ``rate()`` over
any range answers "lately" (the recent data stall of a rank is
``rate(shardserve_client_wait_seconds_total[1m]) / (rate(…wait…[1m]) + rate(…compute…[1m]))``);
per-job series are labelled ``job_id``, never ``job`` (Prometheus' own target label), and exist
while the job is pending, running or idle: a finished, failed, deleted or expired job's series
are gone from the next scrape. A job of more than :data:`RANK_SERIES_MAX` ranks exports its
per-rank series once, ``rank="all"``, summed over its ranks. No ``*_created`` series
(:func:`prometheus_client.disable_created_metrics`).

==========================================  =========  ==============  ============================================
name                                        type       labels          meaning
==========================================  =========  ==============  ============================================
shardserve_batches_sent_total               counter                    batches sent on the data plane (not messages)
shardserve_messages_sent_total              counter                    data-plane messages carrying them (small batches go several to one)
shardserve_bytes_sent_total                 counter                    payload bytes of those batches
shardserve_batches_assembled_total          counter                    batches gathered (and transformed), once for all of a share group's subscribers
shardserve_share_batches_handed_total       counter                    batches a share group's subscriber got from the group's pass, not assembled for it
shardserve_share_bytes                      gauge                      bytes every share group's window keeps now (at most ``--share-bytes``)
shardserve_unread_bytes                     gauge                      bytes allotted to streams that have not read yet (at most ``--unread-bytes``)
shardserve_unread_waiting_streams           gauge                      streams that have not read and wait for room under ``--unread-bytes``
shardserve_assembly_seconds                 histogram                  time to gather one batch from the store
shardserve_streams                          gauge                      open data-plane streams
shardserve_shm_fallbacks_total              counter                    streams that asked for shm and got the socket
shardserve_store_mapped_versions            gauge                      dataset versions held mapped (current ones opened; older ones while a job pins them)
shardserve_plan_cache_bytes                 gauge                      bytes of epoch orders kept, mixture orders too (at most ``--plan-cache-bytes``)
shardserve_store_bytes                      gauge                      bytes of every dataset in the store
shardserve_jobs                             gauge      state           jobs by lifecycle state (every state, 0 too)
shardserve_job_ranks_connected              gauge      job_id          ranks of the job with an open stream
shardserve_job_batches_sent_total           counter    job_id, rank    batches sent to that rank (its jobs' sum is the total while they live)
shardserve_job_bytes_sent_total             counter    job_id, rank    payload bytes sent to that rank
shardserve_client_wait_seconds_total        counter    job_id, rank    seconds the rank's loop waited for data
shardserve_client_compute_seconds_total     counter    job_id, rank    seconds the rank's loop spent between batches
shardserve_mixture_weight                   gauge      job_id, source  a mixture's share (weights normalised) in force
shardserve_mixture_samples_sent_total       counter    job_id, source  samples of that source sent to the job's ranks
shardserve_mixture_share                    gauge      job_id, source  share of that source sent over the ranks' current streams
shardserve_mixture_deviation_sigmas         gauge      job_id          largest gap of those shares from the schedule's, in binomial sigmas
shardserve_quarantined_samples              gauge      dataset         sample ids of the dataset in quarantine
shardserve_job_share_subscribers            gauge      job_id, rank    subscribers of the rank's share groups (``Loader(share=...)``)
shardserve_job_share_lag_batches            gauge      job_id, rank    the largest lag of a subscriber behind its group's front, in batches
shardserve_job_share_batches_handed_total   counter    job_id, rank    batches the rank's subscribers were handed from their group's pass
shardserve_job_share_detaches_total         counter    job_id, rank    times a subscriber of the rank fell behind its group's window
==========================================  =========  ==============  ============================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shardserve.proto.api import JobState

_ASSEMBLY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

#: Every state ``shardserve_jobs`` reports (a state with no job reads 0, not absent).
JOB_STATES: tuple[JobState, ...] = ("pending", "running", "idle", "finished", "failed")


#: Jobs of a larger world size export their per-rank series summed over their ranks, as one
#: series labelled ``rank="all"``: a 65,536-rank job would otherwise add four series per rank
#: that streamed to every scrape (and every Prometheus), and a rank's own figures are on
#: ``GET /v1/jobs/{id}``.
RANK_SERIES_MAX = 64


@dataclass(frozen=True)
class RankSeries:
    """One rank's counters as a scrape exports them (``rank`` ``None``: all of them)."""

    job_id: str
    rank: int | None
    batches: int
    bytes: int
    wait_s: float
    compute_s: float


@dataclass(frozen=True)
class ShareSeries:
    """One rank of a shared job as a scrape exports it (its share groups together; ``rank``
    ``None``: all of its ranks)."""

    job_id: str
    rank: int | None
    subscribers: int
    #: The largest lag behind its group's front of any subscriber now, in batches.
    lag: int
    #: Since the server started (groups that ended included).
    handed: int
    detaches: int


@dataclass
class JobsSnapshot:
    """What the per-job metrics show at one scrape (built by the service)."""

    states: dict[str, int] = field(default_factory=dict)
    #: Ranks connected, for every job whose series are exported.
    connected: dict[str, int] = field(default_factory=dict)
    ranks: list[RankSeries] = field(default_factory=list)
    #: ``(job id, source, share)`` of every live mixture job, at its frontier.
    mixture_weights: list[tuple[str, str, float]] = field(default_factory=list)
    #: ``(job id, source, samples sent)`` of every live mixture job.
    mixture_sent: list[tuple[str, str, int]] = field(default_factory=list)
    #: ``(job id, source, share sent)`` over its ranks' current streams.
    mixture_shares: list[tuple[str, str, float]] = field(default_factory=list)
    #: Job id -> the largest gap of those shares from the schedule's, in binomial sigmas.
    mixture_sigmas: dict[str, float] = field(default_factory=dict)
    #: Quarantined sample ids per dataset.
    quarantined: dict[str, int] = field(default_factory=dict)
    #: Ranks of shared jobs (``Loader(share=...)``).
    shares: list[ShareSeries] = field(default_factory=list)


def fold_ranks(
    ranks: Sequence[RankSeries], shares: Sequence[ShareSeries], world_sizes: dict[str, int]
) -> tuple[list[RankSeries], list[ShareSeries]]:
    """The series of jobs with more than :data:`RANK_SERIES_MAX` ranks summed into one per
    job (``rank=None``; a share lag is the largest); others as they are."""
    big = {j for j, ws in world_sizes.items() if ws > RANK_SERIES_MAX}
    out = [r for r in ranks if r.job_id not in big]
    out_sh = [sh for sh in shares if sh.job_id not in big]
    for jid in sorted(big):
        mine = [r for r in ranks if r.job_id == jid]
        if mine:
            out.append(
                RankSeries(
                    jid,
                    None,
                    sum(r.batches for r in mine),
                    sum(r.bytes for r in mine),
                    sum(r.wait_s for r in mine),
                    sum(r.compute_s for r in mine),
                )
            )
        sh = [x for x in shares if x.job_id == jid]
        if sh:
            out_sh.append(
                ShareSeries(
                    jid,
                    None,
                    sum(x.subscribers for x in sh),
                    max(x.lag for x in sh),
                    sum(x.handed for x in sh),
                    sum(x.detaches for x in sh),
                )
            )
    return out, out_sh


def _rank_label(rank: int | None) -> str:
    return "all" if rank is None else str(rank)


#: The kinds of per-source series a mixture job exports (and per-rank ones a shared job).
_SourceFamily = type[GaugeMetricFamily] | type[CounterMetricFamily]


class _JobCollector(Collector):
    """Per-job series, read from the service at scrape time (so an ended job's vanish)."""

    def __init__(self, snapshot: Callable[[], JobsSnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        return list(self._families(JobsSnapshot()))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(self._snapshot()))

    @staticmethod
    def _families(snap: JobsSnapshot) -> Iterator[Metric]:
        # In the exposition's order: jobs, ranks, mixtures, quarantine, share groups.
        yield from _job_families(snap)
        yield from _rank_families(snap)
        yield from _mixture_families(snap)
        yield from _quarantine_families(snap)
        yield from _share_families(snap)


def _job_families(snap: JobsSnapshot) -> Iterator[Metric]:
    """Jobs by lifecycle state, and each job's ranks connected."""
    jobs = GaugeMetricFamily(
        "shardserve_jobs", "Jobs known to the server, by lifecycle state.", labels=["state"]
    )
    for state in JOB_STATES:
        jobs.add_metric([state], snap.states.get(state, 0))
    yield jobs
    connected = GaugeMetricFamily(
        "shardserve_job_ranks_connected",
        "Ranks of the job with an open data-plane stream.",
        labels=["job_id"],
    )
    for jid, n in sorted(snap.connected.items()):
        connected.add_metric([jid], n)
    yield connected


def _rank_families(snap: JobsSnapshot) -> Iterator[Metric]:
    """Each rank's counters: batches and bytes sent, the loop's wait and compute seconds."""
    per_rank = [
        (
            "shardserve_job_batches_sent",
            "Batches sent to the rank (batches, not messages: small ones travel several "
            "to a message).",
            "batches",
        ),
        ("shardserve_job_bytes_sent", "Payload bytes sent to the rank.", "bytes"),
        (
            "shardserve_client_wait_seconds",
            "Seconds the rank's loop waited for data (client report).",
            "wait_s",
        ),
        (
            "shardserve_client_compute_seconds",
            "Seconds the rank's loop spent between batches (client report).",
            "compute_s",
        ),
    ]
    for name, doc, attr in per_rank:
        fam = CounterMetricFamily(name, doc, labels=["job_id", "rank"])
        for r in snap.ranks:
            fam.add_metric([r.job_id, _rank_label(r.rank)], float(getattr(r, attr)))
        yield fam


def _mixture_families(snap: JobsSnapshot) -> Iterator[Metric]:
    """Each mixture source's weight, samples sent and share sent; each job's deviation."""
    # (job id, source, value) series of mixture jobs.
    per_source: list[tuple[_SourceFamily, str, str, Sequence[tuple[str, str, float]]]] = [
        (
            GaugeMetricFamily,
            "shardserve_mixture_weight",
            "A mixture source's share of batch positions (weights normalised) at the job's frontier.",
            snap.mixture_weights,
        ),
        (
            CounterMetricFamily,
            "shardserve_mixture_samples_sent",
            "Samples of a mixture source sent to the job's ranks (since this server started).",
            snap.mixture_sent,
        ),
        (
            GaugeMetricFamily,
            "shardserve_mixture_share",
            "A mixture source's share of the samples sent over the ranks' current streams.",
            snap.mixture_shares,
        ),
    ]
    for family, name, doc, rows in per_source:
        series = family(name, doc, labels=["job_id", "source"])
        for jid, source, value in rows:
            series.add_metric([jid, source], value)
        yield series
    sigmas = GaugeMetricFamily(
        "shardserve_mixture_deviation_sigmas",
        "Largest gap between a mixture's shares sent and the schedule's over the same "
        "steps, in standard deviations of a binomial draw (above ~4: not what was asked).",
        labels=["job_id"],
    )
    for jid, v in sorted(snap.mixture_sigmas.items()):
        sigmas.add_metric([jid], v)
    yield sigmas


def _quarantine_families(snap: JobsSnapshot) -> Iterator[Metric]:
    """Quarantined sample ids per dataset."""
    quarantined = GaugeMetricFamily(
        "shardserve_quarantined_samples",
        "Sample ids of the dataset in quarantine (skipped by mixture plans).",
        labels=["dataset"],
    )
    for name, n in sorted(snap.quarantined.items()):
        quarantined.add_metric([name], n)
    yield quarantined


def _share_families(snap: JobsSnapshot) -> Iterator[Metric]:
    """Each shared rank's subscribers, lag, batches handed and detaches."""
    per_share: list[tuple[_SourceFamily, str, str, Callable[[ShareSeries], int]]] = [
        (
            GaugeMetricFamily,
            "shardserve_job_share_subscribers",
            "Subscribers of the rank's share groups (Loader(share=...)).",
            lambda sh: sh.subscribers,
        ),
        (
            GaugeMetricFamily,
            "shardserve_job_share_lag_batches",
            "The largest lag of a subscriber behind its share group's front, in batches.",
            lambda sh: sh.lag,
        ),
        (
            CounterMetricFamily,
            "shardserve_job_share_batches_handed",
            "Batches the rank's subscribers were handed from their group's pass.",
            lambda sh: sh.handed,
        ),
        (
            CounterMetricFamily,
            "shardserve_job_share_detaches",
            "Times a subscriber of the rank fell behind its share group's window.",
            lambda sh: sh.detaches,
        ),
    ]
    for kind, name, doc, read in per_share:
        ranks = kind(name, doc, labels=["job_id", "rank"])
        for sh in snap.shares:
            ranks.add_metric([sh.job_id, _rank_label(sh.rank)], float(read(sh)))
        yield ranks


class Metrics:
    """The server's instruments; one instance per server."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # Process-wide switch of the library: a ``*_created`` series per counter is noise.
        disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        # Registered in this order, which is the exposition's.
        self._count_sent(self.registry)
        self._count_held(self.registry)
        self._count_streams(self.registry)
        self._gauge_store(self.registry)

    def _count_sent(self, r: CollectorRegistry) -> None:
        """What the data plane sent and assembled."""
        self.batches_sent = Counter(
            "shardserve_batches_sent",
            "Batches sent on the data plane (batches, not messages: small ones travel several "
            "to a message).",
            registry=r,
        )
        self.messages_sent = Counter(
            "shardserve_messages_sent",
            "Data-plane batch messages sent (each carries one or more batches).",
            registry=r,
        )
        self.bytes_sent = Counter(
            "shardserve_bytes_sent", "Payload bytes of the batches sent.", registry=r
        )
        self.batches_assembled = Counter(
            "shardserve_batches_assembled",
            "Batches gathered from the store (and transformed): a share group's batch counts "
            "once, however many subscribers are sent it.",
            registry=r,
        )

    def _count_held(self, r: CollectorRegistry) -> None:
        """What share groups hand out and hold, and what unread streams hold."""
        self.share_bytes = Gauge(
            "shardserve_share_bytes",
            "Bytes every share group's window keeps now (at most --share-bytes).",
            registry=r,
        )
        self.share_handed = Counter(
            "shardserve_share_batches_handed",
            "Batches a share group's subscriber was handed from the group's pass (the work "
            "sharing saved).",
            registry=r,
        )
        self.unread_bytes = Gauge(
            "shardserve_unread_bytes",
            "Bytes allotted to streams that have not read yet (at most --unread-bytes).",
            registry=r,
        )
        self.unread_waiting = Gauge(
            "shardserve_unread_waiting_streams",
            "Streams that have not read and wait for room under --unread-bytes.",
            registry=r,
        )

    def _count_streams(self, r: CollectorRegistry) -> None:
        """Assembly time, open streams and shared-memory fallbacks."""
        self.assembly_seconds = Histogram(
            "shardserve_assembly_seconds",
            "Seconds to gather one batch from the store into its buffers.",
            buckets=_ASSEMBLY_BUCKETS,
            registry=r,
        )
        self.streams = Gauge("shardserve_streams", "Open data-plane streams.", registry=r)
        self.shm_fallbacks = Counter(
            "shardserve_shm_fallbacks",
            "Streams that asked for shared memory and were served over the socket.",
            registry=r,
        )

    def _gauge_store(self, r: CollectorRegistry) -> None:
        """The store's bytes, mapped versions and plan cache (computed at scrape time)."""
        self.store_bytes = Gauge(
            "shardserve_store_bytes", "Bytes of every dataset in the store.", registry=r
        )
        self.mapped_versions = Gauge(
            "shardserve_store_mapped_versions",
            "Dataset versions the server holds mapped: the current ones opened, and older "
            "ones (replaced or deleted on disk) while a job pins them.",
            registry=r,
        )
        self.plan_cache_bytes = Gauge(
            "shardserve_plan_cache_bytes",
            "Bytes of epoch orders kept, mixture orders too (at most --plan-cache-bytes; or the "
            "newest order when it is larger).",
            registry=r,
        )

    def watch_mapped_versions(self, fn: Callable[[], float]) -> None:
        """Compute ``shardserve_store_mapped_versions`` with ``fn`` at every scrape."""
        self.mapped_versions.set_function(fn)

    def watch_plan_bytes(self, fn: Callable[[], float]) -> None:
        """Compute ``shardserve_plan_cache_bytes`` with ``fn`` at every scrape."""
        self.plan_cache_bytes.set_function(fn)

    def watch_store_bytes(self, fn: Callable[[], float]) -> None:
        """Compute ``shardserve_store_bytes`` with ``fn`` at every scrape."""
        self.store_bytes.set_function(fn)

    def watch_jobs(self, snapshot: Callable[[], JobsSnapshot]) -> None:
        """Export the per-job series from ``snapshot()`` at every scrape."""
        self.registry.register(_JobCollector(snapshot))

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format."""
        return generate_latest(self.registry)
