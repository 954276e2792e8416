"""``GET /``: a server-rendered status page (no JavaScript; the browser re-fetches it).

Datasets, jobs and one row per rank with its progress, throughput, credit in flight and the
data-stall fraction its client reported. A rank whose client waits on data for more than
:data:`DATA_BOUND` of its loop time is marked "data-bound".
"""

from __future__ import annotations

import html
from importlib import resources
from string import Template

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from shardserve.proto.errors import ShardserveError
from shardserve.proto.jobs import DatasetInfo, JobStatus, RankStatus

from .deps import Authorized, ServiceDep

router = APIRouter(tags=["status"], dependencies=Authorized)

#: Stall fraction above which a rank is flagged as waiting on data.
DATA_BOUND = 0.2
REFRESH_S = 2


def _e(v: object) -> str:
    return html.escape(str(v))


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _dataset_row(d: DatasetInfo) -> str:
    fields = ", ".join(f"{f['name']}: {f['dtype']}{list(f['shape'])}" for f in d.fields)  # type: ignore[arg-type]
    return (
        f"<tr><td class='l'>{_e(d.name)}</td><td>{d.num_samples}</td><td>{d.num_shards}</td>"
        f"<td>{_e(_bytes(d.bytes))}</td><td class='l'>{_e(fields)}</td></tr>"
    )


def _rank_row(r: RankStatus) -> str:
    bound = r.stall_fraction is not None and r.stall_fraction > DATA_BOUND
    stall = "—" if r.stall_fraction is None else f"{r.stall_fraction:.0%}"
    if bound:
        stall += " <span class='marker'>data-bound</span>"
    state = "connected" if r.connected else "<span class='off'>disconnected</span>"
    seen = "—" if r.last_seen_s is None else f"{r.last_seen_s:.1f} s ago"
    return (
        f"<tr class='{'databound' if bound else ''}'><td>{r.rank}</td><td class='l'>{state}</td>"
        f"<td>{_e(r.epoch if r.epoch is not None else '—')}</td><td class='l'>{_e(r.transport or '—')}</td>"
        f"<td>{r.next_batch}/{r.num_batches}</td><td>{r.batches_delivered}</td>"
        f"<td>{_e(_bytes(r.bytes_delivered))}</td><td>{r.batches_per_s:.1f}</td><td>{r.credit}</td>"
        f"<td>{stall}</td><td>{seen}</td></tr>"
    )


def _job_section(j: JobStatus) -> str:
    s = j.spec
    state = (
        f"<span class='failed'>failed: {_e(j.error)}</span>" if j.state == "failed" else _e(j.state)
    )
    head = (
        f"<h3>job {_e(j.id)} — {state}</h3><p class='meta'>dataset {_e(s.dataset)} · batch "
        f"{s.batch_size} · world size {s.world_size} · shuffle {_e(s.shuffle)} · epoch {j.epoch} · "
        f"seed {j.seed} · {j.batches_per_epoch} batches per rank per epoch · "
        f"<span class='seen'>{sum(r.connected for r in j.ranks)} of {s.world_size} ranks "
        f"connected</span></p>"
    )
    rows = "\n".join(_rank_row(r) for r in j.ranks)
    return (
        head + "<table class='ranks'><tr><th>rank</th><th class='l'>stream</th><th>epoch</th>"
        "<th class='l'>transport</th><th>next/total</th><th>batches</th><th>bytes</th>"
        "<th>batches/s</th><th>credit</th><th>data stall</th><th>last heard</th></tr>\n"
        + rows
        + "\n</table>"
    )


def _dataset_rows(service: ServiceDep) -> str:
    try:
        rows = "\n".join(_dataset_row(d) for d in service.datasets())
    except ShardserveError as e:  # a remote store that is away: the page still renders
        return f"<tr><td class='l failed' colspan='5'>{_e(e)}</td></tr>"
    return rows or "<tr><td class='l' colspan='5'>no datasets</td></tr>"


def _cache_section(service: ServiceDep) -> str:
    """The remote store's shard cache, when there is one (the store URI carries no secrets)."""
    c = service.cache_summary()
    if c is None:
        return ""
    reads = c["hits"] + c["misses"]
    rate = f"{c['hits'] / reads:.0%}" if reads else "—"
    mean = f"{c['fetch_seconds'] / c['fetches'] * 1000:.0f} ms" if c["fetches"] else "—"
    return (
        f"<h2>shard cache</h2><p class='meta'>store {_e(service.settings.store_shown)} · "
        f"{_e(_bytes(c['used_bytes']))} of {_e(_bytes(c['limit_bytes']))} · hits {c['hits']:.0f} · "
        f"misses {c['misses']:.0f} · hit rate {rate} · fetched {_e(_bytes(c['fetched_bytes']))} "
        f"in {c['fetches']:.0f} shards · mean fetch {mean} · evictions {c['evictions']:.0f}</p>"
    )


@router.get("/", response_class=HTMLResponse)
def status_page(service: ServiceDep) -> HTMLResponse:
    """The human view of datasets, jobs and ranks."""
    template = Template(
        resources.files(__package__).joinpath("templates/status.html").read_text("utf-8")
    )
    info = service.info()
    jobs = service.all_jobs()
    page = template.substitute(
        refresh=REFRESH_S,
        host=_e(info.host),
        version=_e(info.version),
        protocols=_e(",".join(map(str, info.protocols))),
        endpoints=_e(" ".join(info.data_endpoints)),
        streams=service.board.open_streams(),
        dataset_rows=_dataset_rows(service),
        job_sections=("\n".join(_job_section(j) for j in jobs) or "<p>no jobs</p>")
        + _cache_section(service),
    )
    return HTMLResponse(page)
