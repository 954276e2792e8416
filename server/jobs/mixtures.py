"""Mixture jobs on the server: admitting one, its schedule by step, its frontier, its plans.

The planner itself is pure (:mod:`.planning.mixture`, positions within one epoch); this module
turns a job's journaled facts (spec, weight changes, quarantines, sizes) into its arguments:

- a global step is ``epoch * S + batch`` (``S``: the job's batches per epoch), so a schedule
  entry at step ``k`` is, within epoch ``e``, position ``(k - e * S) * world_size * batch_size``
  of the epoch's canonical order (the positions of step ``i`` are ``[i*W*B, (i+1)*W*B)``);
- a step is counted at the world size of the job that holds it: a job that resumed the state
  of a job of another world size (its *origin*) keeps every step of the origin's schedule and
  quarantines at that step's position (:func:`place`), even inside one of its own steps; its
  own changes count its own steps;
- the *frontier* is the first step no rank has been sent or has in flight: a change before it
  would rewrite delivered data (409);
- a rank's stream reads its plan batch by batch (:class:`SteeredPlan`): each batch first tells
  the registry its step (no change may take effect at or before it from then on) and
  follows any change made since the plan was, so a change mid-epoch at step ``k`` reaches
  every rank's batch ``k`` exactly.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from shardserve.proto.api import RankStatus
from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import JobSpec, MixtureSource, WeightChange, env_deal
from shardserve.proto.manifest import FieldSpec, Manifest
from shardserve.proto.parts import SOURCE_PART

from ..planning import RankPlan, num_batches
from ..planning.cache import ORDER_WAIT_S, PlanCache
from ..planning.envs import EnvSteps
from ..planning.mixture import MixSource, Quarantine, Segment, mixture_order
from ..registry.jobs import Job, JobRegistry
from ..registry.quarantine import Quarantines
from ..store.versions import content_id
from ..streaming.board import SourceWindow
from ..streaming.limits import check_batch

#: Longest mixture epoch, in positions, and at most this many times its sources' samples.
MAX_EPOCH_SAMPLES = 1 << 31
#: Spawn key of the environments' mixture seeds (:func:`env_seed`), apart from every other use.
ENV_SEED_KEY = 0x656E76
EPOCH_OVER_SOURCES = 64


def admit(
    spec: JobSpec, manifest: Callable[[str], Manifest], max_batch_bytes: int
) -> tuple[JobSpec, int, tuple[int, ...]]:
    """Check a mixture spec against the store; ``(spec with each source's version pinned,
    positions per epoch, source sizes)``. Every source must exist (404 naming it) and serve
    the job's fields with the same dtype and shape as the first (422 naming source and field).
    """
    if spec.mixture is None:
        raise BadRequest(f"job spec for {spec.dataset!r} has no mixture")
    manifests = [manifest(s.name) for s in spec.mixture]  # DatasetNotFound names the dataset
    # With transforms, ``fields`` names the chain's outputs (checked against the chain): the
    # sources must agree on every stored field, which the chain may read.
    stored = None if spec.transforms else spec.fields
    first = _fields(manifests[0], stored, spec.mixture[0].name)
    for src, m in zip(spec.mixture[1:], manifests[1:], strict=True):
        mine = _fields(m, stored, src.name)
        if list(mine) != list(first):
            raise BadRequest(
                f"mixture source {src.name!r} serves fields {list(mine)}, source "
                f"{spec.mixture[0].name!r} serves {list(first)}: every source must serve the "
                "same fields (set fields=[...] to the ones they share)"
            )
        for name, f in mine.items():
            g = first[name]
            if (f.dtype, f.shape, f.nullable) != (g.dtype, g.shape, g.nullable):
                raise BadRequest(
                    f"mixture source {src.name!r} field {name!r} is {f.dtype}{list(f.shape)}"
                    f"{' nullable' if f.nullable else ''}, but in {spec.mixture[0].name!r} it is "
                    f"{g.dtype}{list(g.shape)}{' nullable' if g.nullable else ''}: sources must "
                    "agree on every field served (leave the field out with fields=[...])"
                )
    if SOURCE_PART in first:
        raise BadRequest(
            f"mixture sources serve a field named {SOURCE_PART!r}, the part that says which "
            "source each sample came from: leave it out with fields=[...]"
        )
    sizes = tuple(m.num_samples for m in manifests)
    pinned: list[MixtureSource] = []
    for src, m in zip(spec.mixture, manifests, strict=True):
        current = content_id(m)
        if src.version is not None and src.version != current:
            raise BadRequest(
                f"mixture source {src.name!r} is pinned to version {src.version}, the store has "
                f"{current}: leave version out to take the current one"
            )
        pinned.append(src.model_copy(update={"version": current}))
    spec = spec.model_copy(update={"mixture": tuple(pinned)})
    check_empty(spec, sizes, tuple(s.weight for s in spec.mixture or ()))
    for c in spec.schedule or ():
        check_empty(spec, sizes, c.weights)
    length = spec.epoch_samples or sum(sizes)
    # An epoch's order is held in memory (4 bytes a position): bounded before it is planned.
    most = min(MAX_EPOCH_SAMPLES, EPOCH_OVER_SOURCES * max(sum(sizes), 1))
    if length > most:
        raise BadRequest(
            f"epoch_samples {length} is more than this server plans for a mixture of "
            f"{sum(sizes)} samples: use epoch_samples <= {most} (several epochs instead)"
        )
    per_sample = max(m.total_bytes / max(m.num_samples, 1) for m in manifests)
    check_batch(spec.batch_size, length, int(per_sample * spec.batch_size), max_batch_bytes)
    return spec, length, sizes


def check_empty(spec: JobSpec, sizes: Sequence[int], weights: Sequence[float]) -> None:
    """Refuse a weight > 0 on a source with no samples: no position could be served."""
    for src, n, w in zip(spec.mixture or (), sizes, weights, strict=True):
        if n == 0 and w > 0:
            raise BadRequest(
                f"mixture source {src.name!r} has no samples, so its weight must be 0, got {w}"
            )


def _fields(m: Manifest, wanted: tuple[str, ...] | None, name: str) -> dict[str, FieldSpec]:
    """The stored fields of source ``m`` a job wants (``source`` is the mixture's own)."""
    by_name = {f.name: f for f in m.fields}
    if wanted is None:
        return by_name
    wanted = tuple(f for f in wanted if f != SOURCE_PART)
    missing = [f for f in wanted if f not in by_name]
    if missing:
        raise BadRequest(
            f"mixture source {name!r} has no field(s) {missing}; its fields are {list(by_name)}"
        )
    return {f: by_name[f] for f in wanted}


def steps_per_epoch(job: Job) -> int:
    """Batches every rank gets in an epoch (``S``): global step = ``epoch * S + batch`` (a
    job of several environments: steps, each one batch of every environment)."""
    s = job.spec
    return num_batches(job.num_samples, s.deal_world, s.env_batch, s.drop_last)


def step_positions(spec: JobSpec) -> int:
    """Positions of one epoch order a global step takes: ``world_size * batch_size``; with
    independent environments each follows an order of its own and a step takes
    ``world_size * batch_size // envs`` positions of each (``split`` ones deal the job's
    one order over ``world_size * envs`` plans, so a step is ``world_size * batch_size``)."""
    return spec.deal_world * spec.env_batch


def env_seed(seed: int, env: int) -> int:
    """The seed of environment ``env``'s mixture order: the job's own for environment 0 (a
    job of one environment plans as it always did), one drawn from ``[seed, env]`` for the
    others, so that each independent environment follows a mixture order of its own.

    >>> env_seed(7, 0), env_seed(7, 1) == env_seed(7, 1) != env_seed(7, 2)
    (7, True)
    """
    if env == 0:
        return seed
    ss = np.random.SeedSequence([seed, env], spawn_key=(ENV_SEED_KEY,))
    return int(ss.generate_state(1, np.uint64)[0])


def weights_at(schedule: Sequence[WeightChange], step: int) -> tuple[float, ...]:
    """The weights in force at global ``step`` (``schedule`` sorted, the first at step 0)."""
    now = schedule[0].weights
    for c in schedule:
        if c.at_step > step:
            break
        now = c.weights
    return now


def asked_over(schedule: Sequence[WeightChange], lo: int, hi: int) -> np.ndarray:
    """The shares the schedule asks for (weights normalised), averaged over global steps
    ``lo..hi-1`` (``schedule`` sorted, the first at step 0).

    >>> asked_over([WeightChange(at_step=0, weights=(1, 0)),
    ...             WeightChange(at_step=10, weights=(0, 1))], 5, 15).tolist()
    [0.5, 0.5]
    """
    total = np.zeros(len(schedule[0].weights))
    for c, nxt in zip(schedule, [*schedule[1:], None], strict=True):
        a, b = max(c.at_step, lo), min(nxt.at_step if nxt is not None else hi, hi)
        if b > a:
            w = np.asarray(c.weights, dtype=np.float64)
            total += (b - a) * w / w.sum()
    return total / max(hi - lo, 1)


def share_figures(
    job: Job, windows: Sequence[SourceWindow]
) -> tuple[int, list[float], list[float], float | None]:
    """Over the ranks' current streams (``windows``): samples, the share of each source sent,
    the share asked for over the same steps, and the largest gap in binomial standard
    deviations (``None`` before any sample)."""
    k = len(job.spec.mixture or ())
    S, schedule = steps_per_epoch(job), job.schedule()
    sent, asked = np.zeros(k), np.zeros(k)
    for w in windows:
        if w.epoch is None or w.next_batch <= w.start:
            continue
        got = np.zeros(k)
        got[: len(w.stream)] = w.stream[:k]
        first = w.epoch * S
        sent += got
        asked += got.sum() * asked_over(schedule, first + w.start, first + w.next_batch)
    n = int(sent.sum())
    if not n:
        return 0, [], [], None
    share, target = sent / n, asked / n
    sigma = np.sqrt(np.maximum(target * (1 - target), 1e-12) / n)
    return n, share.tolist(), target.tolist(), float((np.abs(share - target) / sigma).max())


#: Where a step falls: ``(epoch, position within its epoch)``.
Place = tuple[int, int]


def place(job: Job, step: int) -> Place:
    """The epoch of global ``step`` of ``job`` and the position its first sample has in that
    epoch's order: ``step = e * S + i`` is position ``i * world_size * batch_size`` of epoch
    ``e`` (``S`` and the positions a step takes at ``job``'s own world size).

    A step means a place only together with the job, and so its world size, that counts it:
    a job resumed on another world size keeps the place of every step its origin counted.
    """
    S = max(steps_per_epoch(job), 1)
    return step // S, step % S * step_positions(job.spec)


def segments(job: Job, epoch: int, origin: Job | None = None) -> list[Segment]:
    """The schedule within ``epoch`` as epoch positions. ``origin``: the job of another
    world size whose state ``job`` resumed: its whole schedule (the spec's and the changes
    set on it) holds at the places its own steps name, and the changes set on ``job`` since
    at the places ``job``'s steps name; at one place the later (``job``'s) wins."""
    if origin is None:
        events = [(*place(job, c.at_step), 0, c.weights) for c in job.schedule()]
    else:
        events = [(*place(origin, c.at_step), 0, c.weights) for c in origin.schedule()]
        events += [(*place(job, c.at_step), 1, c.weights) for c in job.changes]
    events.sort(key=lambda e: e[:3])
    before = [e for e in events if (e[0], e[1]) <= (epoch, 0)]
    out = [Segment(0, before[-1][3])]
    out += [Segment(at, w) for e, at, _, w in events if e == epoch and at > 0]
    return out


def quarantines(
    job: Job, epoch: int, q: Quarantines, origin: Job | None = None
) -> list[Quarantine]:
    """The job's quarantines within ``epoch``, as epoch positions (before it: position 0).
    ``origin`` (see :func:`segments`): ids quarantined for it and not for ``job`` are
    skipped from the place of the origin's step."""
    s = job.spec
    out = []
    for k, src in enumerate(s.mixture or ()):
        size = (job.source_sizes or ())[k]
        for (e, at), ids in _quarantine_places(job, src.name, size, q, origin):
            if e <= epoch:
                out.append(Quarantine(k, at if e == epoch else 0, ids))
    return out


def _quarantine_places(
    job: Job, dataset: str, size: int, q: Quarantines, origin: Job | None
) -> list[tuple[Place, np.ndarray]]:
    """``(place, ids)`` of ``dataset``'s quarantined ids below ``size``, for ``job``."""
    if origin is None:
        return [(place(job, t), ids) for t, ids in q.from_step(dataset, job.id, size)]
    out = []
    for entry in q.entries(dataset):
        ids = np.asarray(entry.ids, dtype=np.int64)
        ids = ids[ids < size] if size else ids
        if job.id in entry.at:
            where = place(job, entry.at[job.id])
        elif origin.id in entry.at:
            where = place(origin, entry.at[origin.id])
        else:
            where = (0, 0)
        out.append((where, ids))
    return out


def frontier(job: Job, ranks: Sequence[RankStatus]) -> int:
    """The first global step no rank has been sent or has in flight (``credit`` past the last
    sent, within its epoch: credit left at an epoch's end reaches no step of the next one):
    the earliest a change may take effect."""
    S = steps_per_epoch(job)
    steps = [
        r.epoch * S + min(r.next_batch + r.credit, r.num_batches)
        for r in ranks
        if r.epoch is not None
    ]
    return max(steps, default=0)


class MixturePlans:
    """Mixture orders, kept in a :class:`PlanCache` keyed by everything they depend on (the
    schedule and quarantines within the epoch too); thread-safe."""

    def __init__(
        self,
        quarantine: Quarantines,
        orders: PlanCache,
        origin_of: Callable[[Job], Job | None] = lambda job: None,
    ) -> None:
        """``origin_of(job)``: the job of another world size whose state ``job`` resumed
        (its steps keep their places, see :func:`segments`), or ``None``."""
        self._quarantine = quarantine
        self.orders = orders
        self._origin_of = origin_of

    @property
    def nbytes(self) -> int:
        """Bytes of the orders kept."""
        return self.orders.nbytes

    def order(self, job: Job, epoch: int, seed: int, env: int = 0) -> np.ndarray:
        """The epoch's canonical mixture order over concatenated ids (see the planner);
        ``env``: the order of that independent environment (:func:`env_seed`)."""
        return self.orders.steered_order(*self._steered(job, epoch, seed, env))

    def ready(self, job: Job, epoch: int, seed: int) -> bool:
        """Whether every order :meth:`rank_plan` of ``epoch`` reads is made (never blocks);
        those that are not are planned on the planning lane."""
        s = job.spec
        envs = {0} if s.envs == 1 else {env_deal(s, 0, e)[0] for e in range(s.envs)}
        ready = [self.orders.steered_ready(*self._steered(job, epoch, seed, e)) for e in envs]
        return all(ready)

    def _steered(
        self, job: Job, epoch: int, seed: int, env: int
    ) -> tuple[tuple[object, ...], Callable[[], np.ndarray]]:
        """The cache key of an order (everything it depends on) and how it is made."""
        spec = job.spec
        if spec.mixture is None or job.source_sizes is None:
            raise BadRequest(f"job {job.id} is not a mixture job")
        origin = self._origin_of(job)
        segs = segments(job, epoch, origin)
        quar = quarantines(job, epoch, self._quarantine, origin)
        seed = env_seed(seed, env)
        key = (
            job.id,
            epoch,
            seed,
            tuple((g.at, g.weights) for g in segs),
            tuple((q.source, q.at, hashlib.blake2b(q.ids.tobytes()).hexdigest()) for q in quar),
        )
        sources = [
            MixSource(n, s.on_exhausted)
            for s, n in zip(spec.mixture, job.source_sizes, strict=True)
        ]
        make = partial(
            mixture_order,
            sources,
            seed,
            epoch,
            job.num_samples,
            segs,
            spec.deal_world,
            quar,
            spec.shuffle,
            spec.block_window,
        )
        return key, make

    def rank_plan(
        self, job: Job, epoch: int, seed: int, rank: int, offset: int = 0
    ) -> RankPlan | EnvSteps:
        """``rank``'s batches of ``epoch``; a job of several environments: its steps.
        ``offset``: dealt from that position of the order (an elastic resume)."""
        s = job.spec
        if s.envs == 1:
            order = self.order(job, epoch, seed)
            return RankPlan.from_order(order, s.world_size, rank, s.batch_size, s.drop_last, offset)
        envs = range(s.envs)
        return EnvSteps.of([self.env_plan(job, epoch, seed, rank, e, offset) for e in envs])

    def env_plan(
        self, job: Job, epoch: int, seed: int, rank: int, env: int, offset: int = 0
    ) -> RankPlan:
        """Environment ``env`` of ``rank``: its batches of ``batch_size // envs``, dealt as
        :func:`~shardserve.proto.jobs.env_deal` deals a one-dataset job's."""
        s = job.spec
        which, world, as_rank = env_deal(s, rank, env)
        order = self.order(job, epoch, seed, which)
        return RankPlan.from_order(order, world, as_rank, s.env_batch, s.drop_last, offset)


class SteeredPlan:
    """One rank's mixture plan of an epoch, as its stream reads it (a
    :class:`~.source.StreamPlan`): each :meth:`batch` records its step with the registry
    first, then serves it from the plan of the job's schedule and quarantines as they are
    now (remade when a change came since; the epoch's order is shared by the ranks)."""

    def __init__(
        self,
        plans: MixturePlans,
        registry: JobRegistry,
        job: Job,
        epoch: int,
        seed: int,
        rank: int,
        offset: int = 0,
    ) -> None:
        """``offset``: the plan is dealt from that position (an elastic resume): its batch
        ``i`` then reaches into step ``i + 1`` of the job, which it resolves too."""
        self._plans, self._registry = plans, registry
        self._job_id, self._epoch, self._seed, self._rank = job.id, epoch, seed, rank
        self._offset = offset
        self._first_step = epoch * steps_per_epoch(job) + (1 if offset else 0)
        # The job as it is now, not as the stream's Hello found it: a change may have come
        # between the two, and the generation read with it is the one this plan is of. An
        # epoch whose length depends on the weights is taken whole from here (the Welcome
        # will say its length): changes go to the next epoch's start.
        if job.spec.ends_early:
            job, self._made_at = registry.resolving(job.id, self._first_step)
        else:
            job, self._made_at = registry.steered(job.id)
        self._plan = plans.rank_plan(job, epoch, seed, rank, offset)
        #: When :meth:`ready` first found the plan waiting for a re-plan (``None``: not).
        self._waiting_since: float | None = None

    def __len__(self) -> int:
        return len(self._plan)

    def sample_ids(self) -> np.ndarray:
        """The ids the plan reads as it stands (a fetching source reads ahead of them)."""
        return self._plan.sample_ids()

    def batch(self, i: int) -> np.ndarray:
        return self.span(i, 1)

    def span(self, i: int, count: int) -> np.ndarray:
        last = self._first_step + i + count - 1
        job, now = self._registry.resolving(self._job_id, last)
        if now != self._made_at:
            # A change after the last step read cannot alter batches up to it (the order's
            # prefix stays), and none at or before it is taken any more: the new plan agrees
            # on everything read.
            self._plan = self._plans.rank_plan(
                job, self._epoch, self._seed, self._rank, self._offset
            )
            self._made_at = now
        return self._plan.span(i, count)

    def ready(self, i: int, count: int) -> bool:
        """Whether the plan serves batches ``i..i+count-1`` without planning on the caller's
        thread: the steering is the plan's, or the order of the steering now is made;
        otherwise that order is planned on the planning lane and ``False`` comes back (the
        stream is skipped until it lands). Raises ``TimeoutError`` after
        :data:`~..planning.cache.ORDER_WAIT_S` of waiting, naming the re-plan."""
        job, now = self._registry.steered(self._job_id)
        if now == self._made_at or self._plans.ready(job, self._epoch, self._seed):
            self._waiting_since = None
            return True
        t = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = t
        elif t - self._waiting_since > ORDER_WAIT_S:
            raise TimeoutError(
                f"waited {ORDER_WAIT_S} s for the re-plan of mixture job {self._job_id} epoch "
                f"{self._epoch} after a steering change (generation {now}; batch {i} of rank "
                f"{self._rank}): the planning lane did not finish it"
            )
        return False
