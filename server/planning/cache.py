"""Epoch orders shared by every rank of a job, computed once per (job, epoch, seed).

All ranks of a job stream from the same global order and only stride it differently
(:class:`~shardserve.server.planning.RankPlan`), so the order is computed by whichever rank
asks first and reused by the others. Planning 40 M samples takes about a second, so it runs
on the assembly pool, never on the streamer thread; concurrent askers for the same key wait
for the first (with a deadline) instead of computing it twice.

The cache is an LRU bounded in bytes (``--plan-cache-bytes``; an order costs 4 bytes a
sample), always keeping at least the newest entry: a stream reading an order larger than the
bound holds it anyway, and a smaller one would be computed again at every rank's ask. A flood
of ``GET /v1/jobs/{id}/plan`` for other epochs therefore keeps at most the bound (or one
order), shown as ``shardserve_plan_cache_bytes``.

The next epoch's order is computed while the current one streams (:meth:`PlanCache.plan_ahead`,
on a thread of its own): a 5M-sample global shuffle takes ~0.3 s, which would otherwise be the
wait for the first batch of every epoch. It starts once the current epoch's order is whole
(:meth:`Finishing.then`), not beside the shuffle of its last buckets and its first batches: on
two cores three threads would share them just when a new server sends its first batch.

An epoch no one planned ahead (the first of a job) is not waited for whole either: a global
shuffle lays its samples out in buckets, then shuffles each bucket
(:func:`~.permute.shuffle_steps`). The rank plans of it are handed out once the first bucket is
found and shuffled (the first ~131,072 positions: every rank's first batches), and a thread
of its own lays out and shuffles the other buckets while those batches are gathered; a
plan's read of a later position waits for its bucket (:class:`Finishing`). Same order, same
draws, sooner.

A mixture's orders are kept by the same class (:meth:`PlanCache.steered_order`): the same
waiters and byte bound, keyed by the steering they were made under too.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import numpy as np

from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import env_deal

from ..registry.jobs import Job
from . import RankPlan
from .envs import EnvSteps
from .order import epoch_order_steps

#: Bytes of orders kept across all jobs.
ORDER_CACHE_BYTES = 512 << 20
#: How long a rank waits for another rank's computation of the same order.
ORDER_WAIT_S = 120.0

#: An order's key: ``(job id, epoch, seed, ...)`` and whatever else the order depends on (a
#: one-dataset job's environment; a mixture's schedule and quarantines within the epoch).
OrderKey = tuple[object, ...]
#: Makes an order: the array it is written into and the steps that write it, each yielding
#: how many leading positions are final (see :func:`.order.epoch_order_steps`).
MakeOrder = Callable[[], tuple[np.ndarray, Iterator[int]]]

log = logging.getLogger("shardserve.planning")


class Finishing:
    """An order whose leading positions are final while a thread shuffles the rest: how far
    it got, and the wait of a plan that reads further (bounded, naming the order)."""

    def __init__(self, what: str, n: int, upto: int) -> None:
        self.what, self.n = what, n
        #: Positions ``0 .. upto - 1`` are final.
        self.upto = upto
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._then: list[Callable[[], None]] = []

    def advance(self, upto: int) -> None:
        with self._cond:
            self.upto = upto
            self._cond.notify_all()
        if upto >= self.n:
            self._ended()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()
        self._ended()

    def then(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once every position is final or the shuffle failed: now if it is so
        already, else on the thread that ends it."""
        with self._cond:
            if self.upto < self.n and self.error is None:
                self._then.append(fn)
                return
        fn()

    def _ended(self) -> None:
        with self._cond:
            todo, self._then = self._then, []
        for fn in todo:
            fn()

    def wait(self, position: int) -> None:
        """Return once ``position`` is final; raise if its shuffle failed or took too long."""
        if position < self.upto:  # the common case, without the lock
            return
        with self._cond:
            self._cond.wait_for(
                lambda: position < self.upto or self.error is not None, ORDER_WAIT_S
            )
            if position < self.upto:
                return
            if self.error is not None:
                raise RuntimeError(f"shuffling the rest of {self.what} failed: {self.error}")
            raise TimeoutError(
                f"waited {ORDER_WAIT_S} s for position {position} of {self.what}'s order "
                f"({self.upto} of {self.n} positions shuffled)"
            )


def _stopped(finishing: Finishing, done: Future[None]) -> None:
    """A finishing shuffle dropped before it ran (the server is stopping) fails its waiters."""
    if done.cancelled():
        finishing.fail(RuntimeError("the server stopped"))


def _nothing() -> None:
    """No streamer to wake (a cache used without one)."""


class PlanCache:
    """LRU of epoch orders keyed by ``(job id, epoch, seed, env)``, or by what a steered
    order depends on (:meth:`steered_order`); thread-safe."""

    def __init__(self, max_bytes: int = ORDER_CACHE_BYTES) -> None:
        self._max_bytes = max_bytes
        self._orders: OrderedDict[OrderKey, np.ndarray] = OrderedDict()
        self._computing: dict[OrderKey, threading.Event] = {}
        #: Orders handed out before their last buckets were shuffled, until they are.
        self._finishing: dict[OrderKey, Finishing] = {}
        self._lock = threading.Lock()
        # One thread: planning ahead never takes more than a core from the streams.
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ss-plan-ahead")
        # Another for the rest of an order whose first batches are already out: it must not
        # queue behind the next epochs planned ahead.
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ss-plan-finish")
        #: Orders planned ahead (or waiting to be, see :meth:`plan_ahead`), not yet made.
        self._ahead_keys: set[OrderKey] = set()
        #: Steered orders submitted to the planning lane and not yet made.
        self._queued: set[OrderKey] = set()
        #: Steered orders a stream was told are not ready while another thread made them
        #: (a rank's Hello, an HTTP plan): that thread wakes the streamer when it is done.
        self._awaited: set[OrderKey] = set()
        #: Called when a steered order lands (the streamer's wake-up: a stream skipped
        #: while it was planned is pumped again).
        self._landed: Callable[[], None] = _nothing

    def on_landed(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` whenever a steered order :meth:`steered_ready` said was not ready is
        kept (or failed): from the planning lane, or from the thread that was making it."""
        self._landed = wake

    def plan_ahead(
        self, job: Job, epoch: int, seed: int, shard_rows: np.ndarray | None = None
    ) -> None:
        """Compute ``epoch``'s orders in the background, if they are not cached or being
        computed: the first batch of that epoch then waits for no plan. Same orders as
        :meth:`order` computes (the same function of the same arguments). Starts once the
        order of ``epoch - 1`` is whole, if its last buckets are still being shuffled."""
        for env in range(job.spec.env_orders):
            key = (job.id, epoch, seed, env)
            with self._lock:
                if key in self._orders or key in self._computing or key in self._ahead_keys:
                    continue
                self._ahead_keys.add(key)
                current = self._finishing.get((job.id, epoch - 1, seed, env))
            submit = partial(self._submit_ahead, key, job, epoch, seed, shard_rows, env)
            if current is None:
                submit()
            else:
                current.then(submit)

    def _submit_ahead(
        self,
        key: OrderKey,
        job: Job,
        epoch: int,
        seed: int,
        shard_rows: np.ndarray | None,
        env: int,
    ) -> None:
        try:
            self._ahead.submit(self._order_quietly, key, job, epoch, seed, shard_rows, env)
        except RuntimeError:  # closed: the server is stopping
            with self._lock:
                self._ahead_keys.discard(key)

    def _order_quietly(
        self,
        key: OrderKey,
        job: Job,
        epoch: int,
        seed: int,
        shard_rows: np.ndarray | None,
        env: int,
    ) -> None:
        try:
            self.order(job, epoch, seed, shard_rows, env)
        except Exception:  # a stream asking for it later gets the error, typed, in time
            log.warning("planning epoch %d of job %s ahead failed", epoch, job.id, exc_info=True)
        finally:
            with self._lock:
                self._ahead_keys.discard(key)

    def close(self, wait: bool = False) -> None:
        """Stop planning ahead: drop the orders queued (one running finishes on its own), or
        with ``wait``, plan them all first (the finishing shuffles first: an order planned
        ahead may wait for one)."""
        self._finisher.shutdown(wait=wait, cancel_futures=not wait)
        self._ahead.shutdown(wait=wait, cancel_futures=not wait)

    def order(
        self, job: Job, epoch: int, seed: int, shard_rows: np.ndarray | None = None, env: int = 0
    ) -> np.ndarray:
        """The epoch's global order for ``job``, whole, computing it at most once at a time."""
        order, finishing = self._get(
            (job.id, epoch, seed, env), self._maker(job, epoch, seed, shard_rows, env), False
        )
        if finishing is not None and len(order):
            finishing.wait(len(order) - 1)
        return order

    def steered_order(self, key: OrderKey, make: Callable[[], np.ndarray]) -> np.ndarray:
        """The order of ``key`` (``(job id, epoch, seed, ...)`` and the steering it was made
        under: a mixture's weights and quarantines), made by ``make`` at most once at a time.

        An order of the same job, epoch and seed made under older steering is dropped when
        this one is kept: plans are remade from the job as it is now, so it is never asked
        for again, and a flood of changes keeps one order per epoch, not one per change.
        """

        def steps() -> tuple[np.ndarray, Iterator[int]]:
            order = make()
            return order, iter([len(order)])

        return self._get(key, steps, False, replaces=key[:3])[0]

    def steered_ready(self, key: OrderKey, make: Callable[[], np.ndarray]) -> bool:
        """Whether the order of ``key`` is made (never blocks); if not, it is planned on the
        planning lane (once) unless another thread is making it, and :meth:`on_landed`'s
        callback runs when it is kept either way."""
        with self._lock:
            if key in self._orders:
                return True
            if key in self._queued:
                return False
            if key in self._computing:
                # Made by another thread, which does not wake the streamer on its own: a
                # stream skipped now would wait for a batch no event pumps any more.
                self._awaited.add(key)
                return False
            self._queued.add(key)
        self._ahead.submit(self._steer_ahead, key, make)
        return False

    def _steer_ahead(self, key: OrderKey, make: Callable[[], np.ndarray]) -> None:
        try:
            self.steered_order(key, make)
        except Exception:  # the stream that reads it plans it again and gets the error
            log.warning("re-planning %s on the planning lane failed", key[:3], exc_info=True)
        finally:
            with self._lock:
                self._queued.discard(key)
            self._landed()

    @staticmethod
    def _maker(
        job: Job, epoch: int, seed: int, shard_rows: np.ndarray | None, env: int
    ) -> MakeOrder:
        """How a one-dataset job's order of ``epoch`` (environment ``env``) is made."""
        spec = job.spec
        return partial(
            epoch_order_steps,
            job.num_samples,
            seed,
            epoch,
            spec.shuffle,
            shard_rows=shard_rows,
            block_window=spec.block_window,
            env=env,
        )

    def _get(
        self, key: OrderKey, make: MakeOrder, staged: bool, replaces: OrderKey | None = None
    ) -> tuple[np.ndarray, Finishing | None]:
        """The order and, while its last buckets are being shuffled, how far that got.
        ``staged``: a new order is handed out after its first bucket (see the module
        docstring); else it is computed whole here. ``replaces``: orders whose keys begin
        with it are dropped when this one is kept."""
        job_id, epoch = key[0], key[1]
        while True:
            with self._lock:
                if key in self._orders:
                    self._orders.move_to_end(key)
                    return self._orders[key], self._finishing.get(key)
                event = self._computing.get(key)
                if event is None:
                    event = self._computing[key] = threading.Event()
                    break
            if not event.wait(ORDER_WAIT_S):
                raise TimeoutError(
                    f"waited {ORDER_WAIT_S} s for another rank to plan job {job_id} epoch {epoch}"
                )
        try:
            order, steps = make()
            upto = next(steps)
            finishing = None
            if upto < len(order):
                if staged:
                    finishing = Finishing(f"job {job_id} epoch {epoch}", len(order), upto)
                else:
                    for _ in steps:
                        pass
            with self._lock:
                if replaces is not None:
                    n = len(replaces)
                    for old in [k for k in self._orders if k[:n] == replaces and k != key]:
                        del self._orders[old]
                        self._finishing.pop(old, None)
                self._orders[key] = order
                if finishing is not None:
                    self._finishing[key] = finishing
                self._evict()
            if finishing is not None:
                done = self._finisher.submit(self._finish, key, order, steps, finishing)
                done.add_done_callback(partial(_stopped, finishing))
            return order, finishing
        finally:
            with self._lock:
                self._computing.pop(key, None)
                awaited = key in self._awaited
                self._awaited.discard(key)
            event.set()
            if awaited:
                self._landed()

    def _finish(
        self, key: OrderKey, order: np.ndarray, steps: Iterator[int], finishing: Finishing
    ) -> None:
        """Shuffle the rest of an order handed out early, publishing each bucket."""
        try:
            for upto in steps:
                finishing.advance(upto)
        except BaseException as e:
            log.error("shuffling the rest of %s failed", finishing.what, exc_info=True)
            finishing.fail(e)
            with self._lock:  # a later ask computes it again
                if self._orders.get(key) is order:
                    del self._orders[key]
        finally:
            with self._lock:
                if self._finishing.get(key) is finishing:
                    del self._finishing[key]

    def _ready(
        self, job: Job, epoch: int, seed: int, shard_rows: np.ndarray | None, env: int
    ) -> tuple[np.ndarray, Callable[[int], None] | None]:
        """The order a rank plan deals, and the wait for its positions still being shuffled."""
        key = (job.id, epoch, seed, env)
        order, finishing = self._get(key, self._maker(job, epoch, seed, shard_rows, env), True)
        return order, finishing.wait if finishing is not None else None

    def rank_plan(
        self,
        job: Job,
        epoch: int,
        seed: int,
        rank: int,
        shard_rows: np.ndarray | None = None,
        env: int = 0,
        offset: int = 0,
    ) -> RankPlan | EnvSteps:
        """One rank's batches of the epoch (a strided view of the shared order); ``offset``:
        dealt from that position of the order on (elastic resume)."""
        spec = job.spec
        if spec.envs > 1:  # steps of several environments
            plans = [
                self.env_plan(job, epoch, seed, rank, e, shard_rows, offset)
                for e in range(spec.envs)
            ]
            return EnvSteps.of(plans)
        order, ready = self._ready(job, epoch, seed, shard_rows, env)
        return RankPlan.from_order(
            order, spec.world_size, rank, spec.batch_size, spec.drop_last, offset, ready
        )

    def env_plan(
        self,
        job: Job,
        epoch: int,
        seed: int,
        rank: int,
        env: int,
        shard_rows: np.ndarray | None = None,
        offset: int = 0,
    ) -> RankPlan:
        """Environment ``env``'s own batches of the epoch for ``rank``: of a job that streams
        steps of several environments (``envs > 1``), the ``env``-th part of every step
        (batches of ``batch_size // envs``, dealt as :func:`~shardserve.proto.jobs.env_deal`
        says); of any other job, ``env``'s order cut into batches of ``batch_size`` (resident
        environments); ``offset``: dealt from there."""
        spec = job.spec
        if spec.envs > 1 and not 0 <= env < spec.envs:
            raise BadRequest(
                f"env {env} is out of range for job {job.id}: it streams steps of "
                f"{spec.envs} environments, 0 <= env < {spec.envs}"
            )
        which, world, as_rank = env_deal(spec, rank, env)
        order, ready = self._ready(job, epoch, seed, shard_rows, which)
        return RankPlan.from_order(
            order, world, as_rank, spec.env_batch, spec.drop_last, offset, ready
        )

    def forget(self, job_id: str) -> None:
        """Drop a deleted job's orders."""
        with self._lock:
            for key in [k for k in self._orders if k[0] == job_id]:
                del self._orders[key]
                self._finishing.pop(key, None)

    @property
    def nbytes(self) -> int:
        """Bytes of the orders kept."""
        with self._lock:
            return sum(o.nbytes for o in self._orders.values())

    def _evict(self) -> None:
        total = sum(o.nbytes for o in self._orders.values())
        while len(self._orders) > 1 and total > self._max_bytes:
            _, old = self._orders.popitem(last=False)
            total -= old.nbytes
