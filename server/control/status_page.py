"""``GET /``: a server-rendered status page (no JavaScript; the browser re-fetches it).

The header answers what an operator asks first: how many jobs are live, how many ranks are
connected, and how much of their loop time they spend waiting for data *now* (over the last
few seconds, not since they started). Then the datasets, then the jobs: live ones (running,
pending) first with a row per rank, failed ones next, and idle or finished ones folded away
in a ``<details>`` element. Rates come from what the clients report they received
(:mod:`shardserve.server.streaming.board`), so a rank's batches/s is its loop's real rate and
not the prefetch the server sent ahead. A connected rank whose recent stall is over
:data:`DATA_BOUND` is marked "data-bound"; a rank whose stream fell back from shared memory
to the socket says so, with the reason.
"""

from __future__ import annotations

import contextlib
import html
from importlib import resources
from string import Template

from fastapi import APIRouter
from fastapi.responses import HTMLResponse
from pydantic import ByteSize

from shardserve.proto.api import DatasetInfo, JobStatus, MixtureStatus, RankStatus
from shardserve.proto.errors import JobNotFound, ShardserveError

from ..jobs.lifecycle import LIVE
from .deps import Authorized, ServiceDep
from .transforms import status_section as transforms_section

router = APIRouter(tags=["status"], dependencies=Authorized)

#: Stall fraction above which a rank is flagged as waiting on data.
DATA_BOUND = 0.2
REFRESH_S = 2
#: Idle and finished jobs shown (most recent first); the rest are counted, not listed.
MAX_INACTIVE_SHOWN = 50


def _e(v: object) -> str:
    return html.escape(str(v))


def _bytes(n: float) -> str:
    return ByteSize(int(n)).human_readable()


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def _dataset_row(d: DatasetInfo) -> str:
    fields = ", ".join(f"{f['name']}: {f['dtype']}{f['shape']}" for f in d.fields)
    return (
        f"<tr><td class='l'>{_e(d.name)}</td><td>{d.num_samples}</td><td>{d.num_shards}</td>"
        f"<td>{_e(_bytes(d.bytes))}</td><td class='l'>{_e(fields)}</td></tr>"
    )


def _stall(r: RankStatus) -> float | None:
    """The stall a rank row shows: recent when known, else since the client began."""
    return r.stall_now if r.stall_now is not None else r.stall_fraction


def _rank_row(r: RankStatus) -> str:
    stall = _stall(r)
    bound = r.connected and stall is not None and stall > DATA_BOUND
    cell = _pct(stall)
    if bound:
        cell += " <span class='marker'>data-bound</span>"
    state = "connected" if r.connected else "<span class='off'>disconnected</span>"
    if r.conflict:
        state += f" <span class='fallback' title='{_e(r.conflict)}'>(rank conflict)</span>"
    seen = "—" if r.last_seen_s is None else f"{r.last_seen_s:.1f} s ago"
    transport = _e(r.transport or "—")
    if r.shm_fallback:
        transport += f" <span class='fallback' title='{_e(r.shm_fallback)}'>(shm fallback)</span>"
    return (
        f"<tr class='{'databound' if bound else ''}'><td>{r.rank}</td><td class='l'>{state}</td>"
        f"<td>{_e(r.epoch if r.epoch is not None else '—')}</td><td class='l'>{transport}</td>"
        f"<td>{r.next_batch}/{r.num_batches}</td><td>{r.batches_delivered}</td>"
        f"<td>{_e(_bytes(r.bytes_delivered))}</td><td>{r.batches_per_s:.1f}</td><td>{r.credit}</td>"
        f"<td>{cell}</td><td>{seen}</td></tr>"
    )


#: Colours of a mixture's sources on the chart (repeating past eight).
SOURCE_COLOURS = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#9c755f",
)
CHART_W, CHART_H = 360, 64
#: Shares sent further than this many binomial sigmas from those asked for are marked.
DEVIATION_FLAG = 4.0


def _mixture_line(m: MixtureStatus | None) -> str:
    """A mixture job's shares in force at its frontier, its schedule as a chart of each
    source's share over steps, and the shares sent against those asked for."""
    if m is None:
        return ""
    total = sum(m.weights_now) or 1.0
    shares = " · ".join(
        f"<span style='color:{SOURCE_COLOURS[k % 8]}'>■</span> {_e(n)} {w / total:.0%}"
        for k, (n, w) in enumerate(zip(m.sources, m.weights_now, strict=True))
    )
    sent = ""
    if m.window_shares and m.deviation_sigmas is not None:
        got = " · ".join(
            f"{_e(n)} {a:.1%} of {b:.1%}"
            for n, a, b in zip(m.sources, m.window_shares, m.target_shares, strict=True)
        )
        flag = " class='marker'" if m.deviation_sigmas > DEVIATION_FLAG else ""
        sent = (
            f"<p class='meta mixture'>sent over the current streams ({m.window_samples} "
            f"samples): {got} asked · <span{flag}>largest gap {m.deviation_sigmas:.1f} σ</span></p>"
        )
    return (
        f"<p class='meta mixture'>mixture at step {m.frontier}: {shares} · "
        f"{len(m.schedule) - 1} weight change(s) (GET /v1/jobs/{_e(m.job)}/mixture)</p>"
        f"{_schedule_chart(m)}{sent}"
    )


def _schedule_chart(m: MixtureStatus) -> str:
    """Each source's share over global steps (a step line per source), from step 0 to an
    epoch past the frontier or the last change, with the frontier marked."""
    changes = [(int(c["at_step"]), [float(w) for w in c["weights"]]) for c in m.schedule]
    end = max(m.frontier, changes[-1][0]) + max(m.batches_per_epoch, 1)

    def x(step: int) -> float:
        return round(CHART_W * step / end, 1)

    lines = []
    for k in range(len(m.sources)):
        points = []
        for i, (at, weights) in enumerate(changes):
            y = round(CHART_H * (1 - weights[k] / (sum(weights) or 1.0)), 1)
            nxt = changes[i + 1][0] if i + 1 < len(changes) else end
            points += [f"{x(at)},{y}", f"{x(nxt)},{y}"]
        lines.append(
            f"<polyline fill='none' stroke-width='2' stroke='{SOURCE_COLOURS[k % 8]}' "
            f"points='{' '.join(points)}'/>"
        )
    front = x(m.frontier)
    return (
        f"<svg class='mixchart' width='{CHART_W}' height='{CHART_H}' role='img' "
        f"aria-label='share of each source over steps 0 to {end}'>"
        f"<rect width='{CHART_W}' height='{CHART_H}' fill='none' stroke='#ccc'/>{''.join(lines)}"
        f"<line x1='{front}' x2='{front}' y1='0' y2='{CHART_H}' stroke='#999' "
        f"stroke-dasharray='3 2'><title>frontier: step {m.frontier}</title></line></svg>"
    )


def _state_label(state: str, connected: int) -> str:
    """What the page calls a job: a live job with no rank connected is not training yet (or
    between two epochs, or all its ranks are gone), whatever its lifecycle state says."""
    return "waiting for ranks" if state in LIVE and connected == 0 else state


def _job_section(j: JobStatus, mixture: MixtureStatus | None = None) -> str:
    s = j.spec
    connected = sum(r.connected for r in j.ranks)
    state = (
        f"<span class='failed'>failed: {_e(j.error)}</span>"
        if j.state == "failed"
        else f"<span class='state {_e(j.state)}'>{_e(_state_label(j.state, connected))}</span>"
    )
    epochs = sorted({r.epoch for r in j.ranks if r.connected and r.epoch is not None})
    streaming = f"streaming epoch {', '.join(map(str, epochs))} · " if epochs else ""
    # The job's own epoch matters only to clients that ask for it (PUT .../epoch set it).
    default = f"default epoch {j.epoch} (PUT) · " if j.epoch else ""
    fallbacks = sorted({r.shm_fallback for r in j.ranks if r.shm_fallback})
    fallback = "".join(
        f"<p class='fallback'>shared memory fallback: {_e(f)}; this job's streams use the socket</p>"
        for f in fallbacks
    ) + "".join(
        f"<p class='fallback conflict'>rank conflict: {_e(r.conflict)}</p>"
        for r in j.ranks
        if r.conflict
    )
    head = (
        f"<h3 class='job' id='job-{_e(j.id)}'>job {_e(j.id)} — {state}</h3><p class='meta'>"
        f"dataset {_e(s.dataset)} · batch {s.batch_size} · world size {s.world_size} · "
        f"shuffle {_e(s.shuffle)} · {streaming}{default}seed {j.seed} · "
        f"{j.batches_per_epoch} batches per rank per epoch · "
        f"<span class='seen'>{connected} of {s.world_size} ranks "
        f"connected</span></p>{_mixture_line(mixture)}{fallback}"
    )
    if j.resumed_from:  # elastic resume: the job of another world size this one continues
        head += (
            f"<p class='meta resumed'>resumed from job <a href='#job-{_e(j.resumed_from)}'>"
            f"{_e(j.resumed_from)}</a> (another world size)</p>"
        )
    if not j.ranks:
        return head + "<p class='meta'>no rank has opened a stream yet</p>"
    rows = "\n".join(_rank_row(r) for r in j.ranks)
    return (
        head
        + _shares_table(j)
        + "<table class='ranks'><tr><th>rank</th><th class='l'>stream</th><th>epoch</th>"
        "<th class='l'>transport</th><th>next/total</th><th>batches</th><th>bytes</th>"
        "<th>batches/s</th><th>credit</th><th>data stall</th><th>last heard</th></tr>\n"
        + rows
        + "\n</table>"
    )


def _shares_table(j: JobStatus) -> str:
    """A shared job's groups: subscribers, how far each is behind, and the work saved."""
    if not j.shares:
        return ""
    rows = "\n".join(
        f"<tr><td class='l'>{_e(g.share)}</td><td>{g.rank}</td><td>{g.epoch}</td>"
        f"<td>{g.subscribers}</td><td class='l'>{', '.join(map(str, g.lags))}</td>"
        f"<td>{g.kept}/{g.window}</td><td>{g.assembled:,}</td><td>{g.handed:,}</td>"
        f"<td>{g.own:,}</td><td>{g.detaches}</td>"
        f"<td>{g.handed / max(g.assembled + g.handed + g.own, 1):.0%}</td></tr>"
        for g in j.shares
    )
    return (
        "<table class='shares'><tr><th class='l'>share</th><th>rank</th><th>epoch</th>"
        "<th>subscribers</th><th class='l'>behind the front</th><th>window</th>"
        "<th>assembled</th><th>handed</th><th>own passes</th><th>detaches</th>"
        "<th title='batches delivered without an assembly of their own'>saved</th></tr>\n"
        + rows
        + "\n</table>"
    )


def _jobs_html(jobs: list[JobStatus], mixtures: dict[str, MixtureStatus]) -> str:
    if not jobs:
        return "<p>no jobs</p>"
    shown = [j for j in jobs if j.state in ("running", "pending", "failed")]
    folded = [j for j in jobs if j.state not in ("running", "pending", "failed")]
    out = "\n".join(_job_section(j, mixtures.get(j.id)) for j in shown) or "<p>no live jobs</p>"
    if folded:
        more = len(folded) - MAX_INACTIVE_SHOWN
        body = "\n".join(_job_section(j, mixtures.get(j.id)) for j in folded[:MAX_INACTIVE_SHOWN])
        if more > 0:
            body += f"<p class='meta'>and {more} more (GET /v1/jobs lists every job)</p>"
        idle = sum(j.state == "idle" for j in folded)
        out += (
            f"\n<details id='inactive'><summary>{idle} idle, {len(folded) - idle} finished "
            f"job(s)</summary>\n{body}\n</details>"
        )
    return out


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


def _sizing_line(service: ServiceDep) -> str:
    """The pool sizes and why each was chosen (the machine's share, or given by flag/env)."""
    sizing = service.settings.sizing
    m = sizing.machine
    parts = " · ".join(
        f"{_e(c.name.replace('_', ' '))} <b>{_e(_bytes(c.value) if c.name.endswith('_bytes') else c.value)}</b> ({_e(c.reason)})"
        for c in sizing.choices
    )
    return (
        f"sized for {m.cpus:g} CPUs ({_e(m.cpu_reason)}) and {_e(_bytes(m.memory_bytes))} "
        f"({_e(m.memory_reason)}): {parts}"
    )


def _processes_section(service: ServiceDep) -> str:
    """The streaming processes, when the server runs some (``--stream-processes``)."""
    if service.processes is None:
        return ""
    rows = "".join(
        f"<tr><td>{p.index}</td><td>{p.pid}</td><td>{'up' if p.up else 'starting'}</td>"
        f"<td>{p.streams}</td><td>{p.ranks}</td><td>{p.restarts}</td><td>{_e(' '.join(p.data_endpoints))}</td></tr>"
        for p in service.processes.processes()
    )
    return (
        "<h2 id='processes'>Streaming processes</h2><table><tr><th>process</th><th>pid</th>"
        "<th>state</th><th>streams</th><th>ranks placed</th><th>restarts</th><th>data endpoints</th></tr>"
        f"{rows}</table><p>Process 0, the main one, serves clients that do not ask where to "
        "go, and mixtures. A process that died is replaced; counters it reported are kept, "
        "its last second of counts may be lost.</p>"
    )


@router.get("/", response_class=HTMLResponse)
def status_page(service: ServiceDep) -> HTMLResponse:
    """The human view of datasets, jobs and ranks."""
    template = Template(
        resources.files(__package__).joinpath("templates/status.html").read_text("utf-8")
    )
    info = service.info()
    jobs = service.job_admin.all_jobs()
    mixtures: dict[str, MixtureStatus] = {}
    for j in jobs:
        with contextlib.suppress(JobNotFound):  # deleted since the list was taken
            steering = service.kinds.of(j.spec).steering(j.id)
            if steering is not None:
                mixtures[j.id] = steering
    live = sum(j.state in ("running", "pending") for j in jobs)
    ranks = sum(r.connected for j in jobs for r in j.ranks)
    page = template.substitute(
        refresh=REFRESH_S,
        host=_e(info.host),
        version=_e(info.version),
        protocols=_e(",".join(map(str, info.protocols))),
        endpoints=_e(" ".join(info.data_endpoints)),
        sizing=_sizing_line(service),
        jobs_live=live,
        jobs_total=len(jobs),
        ranks_connected=ranks,
        stall_now=_pct(service.board.stall_now()),
        dataset_rows=_dataset_rows(service),
        job_sections=_processes_section(service)
        + _jobs_html(jobs, mixtures)
        + _cache_section(service)
        + transforms_section(service),
        warnings=(
            f"<p class='failed' id='journal'>{_e(service.journal_problem)}</p>"
            if service.journal_problem
            else ""
        ),
    )
    return HTMLResponse(page)
