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
from typing import TYPE_CHECKING, Any

from ._cut import cut_rows
from ._position import Start
from .envs import cut_steps
from .resident import EnvPlan, Resident
from .stream import EpochStream
from .types import Batch

if TYPE_CHECKING:
    from .loader import Loader


class _Pass(Iterator[Any]):
    """What both passes share: the checks before each step, and the end of the epoch."""

    def __init__(self, loader: Loader, number: int, start: Start) -> None:
        self.loader, self.number, self.start = loader, number, start
        self.finished = False

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> Any:
        if self.finished:
            raise StopIteration
        lo = self.loader
        if lo._closed:
            raise RuntimeError("this Loader was closed while iterating")
        if lo._pass != self.number:
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
            lo._pos.ended(self.start)
            lo._stats.pause()
            raise StopIteration
        return item

    def _step(self) -> Any:
        raise NotImplementedError

    def _abandon(self) -> None:
        self.loader._stats.pause()


class StreamPass(_Pass):
    """The rest of an epoch from its stream; a message of several batches is cut into them
    (:mod:`._cut`) and handed out one per step."""

    def __init__(
        self,
        loader: Loader,
        number: int,
        start: Start,
        stream: EpochStream,
        rebuild: Callable[[Batch], Any] | None,
    ) -> None:
        super().__init__(loader, number, start)
        self.stream, self.rebuild = stream, rebuild
        #: Steps of the last message not handed out yet: (index, batch or env batches).
        self.pending: deque[tuple[int, Batch | list[Batch]]] = deque()
        self._batch_bytes = 0

    def _step(self) -> Any:
        lo, stream = self.loader, self.stream
        t0 = lo._stats.start_wait()
        if not self.pending and not self._receive():
            return None
        index, step = self.pending.popleft()
        rebuild = self.rebuild
        if isinstance(step, list):  # several environments' batches (client/envs.py)
            out: Any = [rebuild(b) for b in step] if rebuild is not None else step
        else:
            out = rebuild(step) if rebuild is not None else step
        lo._stats.delivered(t0, self._batch_bytes)
        stream.consumed()
        lo._pos.received(self.start, index)
        return out

    def _receive(self) -> bool:
        """The next message's steps into ``pending``; ``False`` at the end of the epoch."""
        lo, stream = self.loader, self.stream
        ring = lo._rings.ring
        if ring is not None:
            # Slots of batches the loop has dropped go back. Only between messages: batches
            # of the last one may still be waiting in ``pending``, over its slot.
            ring.ledger.collect()
        item = stream.next()
        if item is None:
            return False
        header, frames = item
        if stream.welcome is not None:
            lo._pos.num_batches = stream.welcome.num_batches
        batch = lo._delivery(stream.ring, header, frames)
        lo._stats.messages += 1
        steps: list[Batch] | list[list[Batch]]
        if lo._step_envs:
            steps = cut_steps(batch, header.rows, header.count, lo._step_envs)
        else:
            steps = cut_rows(batch, header.rows, header.count)
        first = header.index
        self.pending.extend(zip(range(first, first + header.count), steps, strict=True))
        self._batch_bytes = header.nbytes // header.count
        return True

    def _abandon(self) -> None:
        super()._abandon()
        self.pending.clear()
        if self.loader._active is self.stream:
            self.loader._active = None


class ResidentPass(_Pass):
    """The rest of an epoch gathered from resident data, one batch per environment."""

    def __init__(
        self,
        loader: Loader,
        number: int,
        start: Start,
        resident: Resident,
        rebuild: Callable[[Batch], Any] | None,
    ) -> None:
        super().__init__(loader, number, start)
        self.resident, self.rebuild, self.index = resident, rebuild, start[1]
        self.plans: list[EnvPlan] | None = None  # fetched at the first next(), not at iter()

    def _step(self) -> Any:
        lo, i = self.loader, self.index
        if self.plans is None:
            self.plans = self.resident.epoch(self.start[0], self.start.offset)
            lo._pos.num_batches = self.plans[0].num_batches
        if i >= lo._pos.num_batches:
            return None
        t0 = lo._stats.start_wait()
        batches = [p.batch(i) for p in self.plans]
        if self.rebuild is not None:
            batches = [self.rebuild(b) for b in batches]
        nbytes = self.resident.sample_nbytes * lo.spec.batch_size * len(batches)
        lo._stats.delivered(t0, nbytes)
        lo._pos.received(self.start, i)
        self.index = i + 1
        return batches if len(batches) > 1 else batches[0]
