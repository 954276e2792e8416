"""Which process serves a stream: the rule, over a table of what each process holds.

In this order (see ``docs/concepts/streaming-processes.md``):

1. a rank already placed stays where it is: its holder's fencing, and its client's next
   epochs and resumes with their ring and its faulted-in pages, stay in one process;
2. a mixture's streams stay in the main process, where the registry resolves its steps;
3. a shared job's subscribers join the process that runs its share group;
4. else the least loaded live process: its open streams, and the ranks placed on it whose
   first stream it has not reported open yet (a report can come between a placement and
   its Hello, and must not make the placement look free).

The design placed a client's new job by its last process too; one trainer process often holds
several Loaders (ranks in one test, a train and a validation job), which that rule piled into
one process, while rule 1 already keeps what a ring handover needs.

Thread-safe: HTTP threads place, the link thread reports.

>>> t = PlacementTable(2)
>>> t.live(1, ["tcp://127.0.0.1:7001"]); t.live(2, ["tcp://127.0.0.1:7002"])
>>> t.place("j", 0, shared=False, anywhere=True)
1
>>> t.place("j", 1, shared=False, anywhere=True)
2
>>> t.place("j", 0, shared=False, anywhere=True)
1
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

#: The main process's index: it serves protocol-3 clients, mixtures and any stream placed
#: while no streaming process is up.
MAIN = 0


@dataclass
class _Process:
    endpoints: list[str] = field(default_factory=list)
    up: bool = False
    streams: int = 0
    #: Ranks placed here whose stream it has not reported open yet.
    pending: set[tuple[str, int]] = field(default_factory=set)


class PlacementTable:
    """What each of ``n`` streaming processes holds, and where a new stream goes."""

    def __init__(self, n: int) -> None:
        self._lock = threading.Lock()
        self._procs = {k: _Process() for k in range(1, n + 1)}
        self._ranks: dict[tuple[str, int], int] = {}
        self._shares: dict[str, int] = {}

    def live(self, k: int, endpoints: list[str]) -> None:
        """Process ``k`` is up and serves on ``endpoints``."""
        with self._lock:
            self._procs[k] = _Process(list(endpoints), True)

    def down(self, k: int) -> None:
        """Process ``k`` died: what it held is placed afresh."""
        with self._lock:
            self._procs[k] = _Process()
            self._ranks = {key: v for key, v in self._ranks.items() if v != k}
            self._shares = {key: v for key, v in self._shares.items() if v != k}

    def reported(self, k: int, streams: int, opened: list[tuple[str, int]]) -> None:
        """Process ``k`` has ``streams`` open; ``opened``: the ``(job, rank)`` of those opened
        since its last report (their placements are counted in ``streams`` from now on)."""
        with self._lock:
            p = self._procs[k]
            p.streams = streams
            p.pending.difference_update(opened)

    def endpoints(self, k: int) -> list[str]:
        with self._lock:
            return list(self._procs[k].endpoints) if k != MAIN else []

    def place(self, job: str, rank: int, *, shared: bool, anywhere: bool) -> int:
        """The process for ``job``'s ``rank``; recorded. ``shared``: the job is shared
        (subscribers join one group); ``anywhere``: its streams may leave the main process (a
        mixture's may not)."""
        with self._lock:
            k = self._choose(job, rank, shared, anywhere)
            self._ranks[(job, rank)] = k
            if shared:
                self._shares[job] = k
            if k != MAIN:
                self._procs[k].pending.add((job, rank))  # until its stream is reported open
            return k

    def claim_main(self, job: str, rank: int) -> int:
        """A Hello reached the main process directly: the process that holds the rank (the
        main one unless placed elsewhere, which then takes the rank's next Hello)."""
        with self._lock:
            return self._ranks.setdefault((job, rank), MAIN)

    def move(self, job: str, rank: int, k: int) -> None:
        """The rank is served by process ``k`` after all (its placement was not confirmed)."""
        with self._lock:
            was = self._ranks.get((job, rank))
            if was is not None and was != MAIN:
                self._procs[was].pending.discard((job, rank))
            self._ranks[(job, rank)] = k

    def loads(self) -> dict[int, tuple[int, int]]:
        """Streams open in each process as last reported, and ranks placed on it."""
        with self._lock:
            ranks = dict.fromkeys(self._procs, 0)
            for k in self._ranks.values():
                if k != MAIN:
                    ranks[k] += 1
            return {k: (p.streams, ranks[k]) for k, p in self._procs.items()}

    def serving(self, job: str) -> list[int]:
        """The streaming processes ranks of ``job`` were placed on."""
        with self._lock:
            return sorted({k for (j, _), k in self._ranks.items() if j == job and k != MAIN})

    def forget_job(self, job: str) -> None:
        """The job ended: its ranks are placed afresh if it comes back."""
        with self._lock:
            for key in [key for key in self._ranks if key[0] == job]:
                del self._ranks[key]
            for p in self._procs.values():
                p.pending = {key for key in p.pending if key[0] != job}
            self._shares.pop(job, None)

    def _choose(self, job: str, rank: int, shared: bool, anywhere: bool) -> int:
        up = [k for k, p in self._procs.items() if p.up]
        held = self._ranks.get((job, rank))
        if held is not None and (held == MAIN or held in up):
            return held
        if not anywhere or not up:
            return MAIN
        if shared and self._shares.get(job) in up:
            return self._shares[job]
        return min(up, key=lambda k: (self._procs[k].streams + len(self._procs[k].pending), k))
