"""One iteration of a Loader (``iter(loader)``): an epoch's batches from a stream or from
resident data, each handed to the loop exactly once.

A pass is an iterator object, not a generator, so that the position moves in the last step
before ``__next__`` returns: a generator resumed after its ``yield`` checks for signals before
running a line of its own, so a Ctrl-C there would land after the loop already had the batch.
Between that step and the ``for`` loop's own variable nothing checks for signals, so a batch
counts as delivered exactly when the loop has it.

An exception out of a step (a Ctrl-C anywhere in the client, a stall, a server error) ends
the pass, as it would a generator, and gives up its stream: whatever the stream was doing
(a batch half-read, a Credit half-sent) is left behind, and the next ``iter(loader)`` opens a
fresh stream at the position, whose Hello re-states credit and held slots from scratch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ._cut import cut_rows
from ._delivery import Delivery
from ._position import Position, Start
from .envs import cut_steps
from .resident import EnvPlan, Resident
from .shm import RingCache
from .stats import StatsClock
from .stream import EpochStream
from .types import Batch


class PassWatcher(Protocol):
    """Told where a pass is (a framework's view of "the current dataloader", see
    :mod:`.habits`): it began, the batch it hands out is the epoch's last, it ended."""

    def begin(self) -> None: ...
    def last_batch(self) -> None: ...
    def end(self) -> None: ...


@dataclass
class PassContext:
    """What a pass reads and moves of the iterable it belongs to (a Loader, or the store-order
    load of resident data), so that a pass never reaches into that object."""

    pos: Position
    stats: StatsClock
    rings: RingCache
    delivery: Delivery
    #: Streaming envs: the device of each environment of a step; empty for one batch a step.
    step_envs: list[torch.device] = field(default_factory=list)
    #: Samples per batch (per environment), for the byte counts of resident passes.
    batch_size: int = 1
    #: Set by the owner's ``close()``: a pass then refuses to go on.
    closed: bool = False
    #: The number of the live pass; an older pass refuses to go on.
    current: int = 0
    #: The stream the live pass reads (``None`` once it was given up).
    active: EpochStream | None = None
    #: Makes a watcher for each new pass (``None``: nobody watches).
    watch: Callable[[], PassWatcher | None] | None = None


class _Pass(Iterator[Any]):
    """What both passes share: the checks before each step, and the end of the epoch."""

    def __init__(self, ctx: PassContext, number: int, start: Start, owner: object) -> None:
        self.ctx, self.number, self.start = ctx, number, start
        # The iterable this pass is of, kept alive while the pass is: in
        # ``for batch in Loader(...)`` the loop holds only the pass, and a Loader that nothing
        # held would be collected, and closed, after its first batch.
        self.owner = owner
        self.finished = False
        self.watcher = ctx.watch() if ctx.watch is not None else None
        if self.watcher is not None:
            self.watcher.begin()

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> Any:
        if self.finished:
            raise StopIteration
        ctx = self.ctx
        if ctx.closed:
            raise RuntimeError("this Loader was closed while iterating")
        if ctx.current != self.number:
            # Both would read one socket: the newer iterator would lose batches to this one.
            raise RuntimeError("this iterator was replaced by a newer iter(loader); use that one")
        try:
            item = self._step()
        except BaseException:
            self.finished = True
            self._abandon()
            raise
        if item is None:
            self.finished = True
            ctx.pos.ended(self.start)
            ctx.stats.pause()
            self._unwatch()
            raise StopIteration
        return item

    def _step(self) -> Any:
        raise NotImplementedError

    def _delivered(self, index: int) -> None:
        """Batch ``index`` is about to reach the loop (the last thing before it does)."""
        if self.watcher is not None and index + 1 >= self.ctx.pos.num_batches:
            self.watcher.last_batch()
        self.ctx.pos.received(self.start, index)

    def _unwatch(self) -> None:
        if self.watcher is not None:
            self.watcher.end()
            self.watcher = None

    def _abandon(self) -> None:
        self.ctx.stats.pause()
        self._unwatch()

    def __del__(self) -> None:
        # A pass dropped mid-epoch (a ``break``) stops being the framework's current one.
        if getattr(self, "watcher", None) is not None:
            self._unwatch()


class StreamPass(_Pass):
    """The rest of an epoch from its stream; a message of several batches is cut into them
    (:mod:`._cut`) and handed out one per step."""

    def __init__(
        self,
        ctx: PassContext,
        number: int,
        start: Start,
        stream: EpochStream,
        rebuild: Callable[[Batch], Any] | None,
        owner: object = None,
    ) -> None:
        super().__init__(ctx, number, start, owner)
        self.stream, self.rebuild = stream, rebuild
        #: Steps of the last message not handed out yet: (index, batch or env batches).
        self.pending: deque[tuple[int, Batch | list[Batch]]] = deque()
        self._batch_bytes = 0

    def _step(self) -> Any:
        ctx, stream = self.ctx, self.stream
        t0 = ctx.stats.start_wait()
        if not self.pending and not self._receive():
            return None
        index, step = self.pending.popleft()
        rebuild = self.rebuild
        if isinstance(step, list):  # several environments' batches (client/envs.py)
            out: Any = [rebuild(b) for b in step] if rebuild is not None else step
        else:
            out = rebuild(step) if rebuild is not None else step
        ctx.stats.delivered(t0, self._batch_bytes)
        stream.consumed()
        self._delivered(index)
        return out

    def _receive(self) -> bool:
        """The next message's steps into ``pending``; ``False`` at the end of the epoch."""
        ctx, stream = self.ctx, self.stream
        ring = ctx.rings.ring
        if ring is not None:
            # Slots of batches the loop has dropped go back. Only between messages: batches
            # of the last one may still be waiting in ``pending``, over its slot.
            ring.ledger.collect()
        item = stream.next()
        if item is None:
            return False
        header, frames = item
        if stream.welcome is not None:
            ctx.pos.num_batches = stream.welcome.num_batches
        batch = ctx.delivery(stream.ring, header, frames)
        ctx.stats.messages += 1
        steps: list[Batch] | list[list[Batch]]
        if ctx.step_envs:
            steps = cut_steps(batch, header.rows, header.count, ctx.step_envs)
        else:
            steps = cut_rows(batch, header.rows, header.count)
        first = header.index
        self.pending.extend(zip(range(first, first + header.count), steps, strict=True))
        self._batch_bytes = header.nbytes // header.count
        return True

    def _abandon(self) -> None:
        super()._abandon()
        self.pending.clear()
        if self.ctx.active is self.stream:
            self.ctx.active = None


class ResidentPass(_Pass):
    """The rest of an epoch gathered from resident data, one batch per environment."""

    def __init__(
        self,
        ctx: PassContext,
        number: int,
        start: Start,
        resident: Resident,
        rebuild: Callable[[Batch], Any] | None,
        owner: object = None,
    ) -> None:
        super().__init__(ctx, number, start, owner)
        self.resident, self.rebuild, self.index = resident, rebuild, start[1]
        self.plans: list[EnvPlan] | None = None  # fetched at the first next(), not at iter()

    def _step(self) -> Any:
        ctx, i = self.ctx, self.index
        if self.plans is None:
            self.plans = self.resident.epoch(self.start[0], self.start.offset)
            ctx.pos.num_batches = self.plans[0].num_batches
        if i >= ctx.pos.num_batches:
            return None
        t0 = ctx.stats.start_wait()
        batches = [p.batch(i) for p in self.plans]
        if self.rebuild is not None:
            batches = [self.rebuild(b) for b in batches]
        nbytes = self.resident.sample_nbytes * ctx.batch_size * len(batches)
        ctx.stats.delivered(t0, nbytes)
        self.index = i + 1
        self._delivered(i)
        return batches if len(batches) > 1 else batches[0]
