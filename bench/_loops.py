"""Measuring a training loop's epochs, as ``bench_small.py`` and its neighbours do: samples/s,
this process's CPU per batch and the server's, each row the best of its epochs.

::

    rows = measure_together({"trainer": Contender(trainer_epochs, 16),
                             "Loader": Contender(loader_epochs, 16, server_pid(store), ld)})
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from bench_transforms import tree_cpu

from shardserve.client import Loader

#: The second server's options: transforms in worker processes.
PROCESS_POOL = ("--transform-pool", "process")
Step = Any  # a batch (dict of tensors) or a list of them


def touch(step: Step) -> None:
    # Reads one element of every tensor: the batch must exist, the loop adds no real work.
    for b in step if isinstance(step, list) else [step]:
        for t in b.values():
            if isinstance(t, torch.Tensor):  # a PyG Batch also holds counts
                float(t.reshape(-1)[-1])


def server_pid(store: Path, processes: bool = False) -> int | None:
    """The pid of the server of ``store`` (``processes``: the one started with
    ``PROCESS_POOL``)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            pooled = PROCESS_POOL[0].encode() in cmd
            if b"serve" in cmd and str(store).encode() in cmd and pooled == processes:
                return int(proc.name)
    return None


def cpu_of(pid: int | None) -> float:
    """CPU seconds of server ``pid`` and of its transform worker processes."""
    return float("nan") if pid is None else tree_cpu(pid)


@dataclass
class Contender:
    """One row of a measurement: its epochs and whose CPU it costs."""

    epoch: Callable[[int], Iterable[Step]]
    per_step: int
    server: int | None = None
    loader: Loader | None = None

    def warm(self) -> None:
        """Epoch 0, unmeasured; its last batch is let go on return. A batch held on keeps
        its shared-memory slot, and the Loader copies further batches out while the loop
        holds half the ring: a held warm-up batch made every shogi batch a copy."""
        for b in self.epoch(0):
            touch(b)

    def run(self, e: int) -> dict[str, float]:
        """Epoch ``e``, measured: samples/s, trainer and server CPU per batch, steps a message."""
        s0, c0, w0 = cpu_of(self.server), time.process_time(), time.perf_counter()
        m0 = self.loader.stats().messages if self.loader is not None else 0
        steps = 0
        for b in self.epoch(e):
            touch(b)
            steps += 1
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        srv = cpu_of(self.server) - s0
        batches = steps * (len(b) if isinstance(b, list) else 1)
        messages = self.loader.stats().messages - m0 if self.loader is not None else 0
        return {
            "samples_s": steps * self.per_step / wall,
            "steps_s": steps / wall,
            "client_cpu_us_per_batch": cpu / batches * 1e6,
            "server_cpu_us_per_batch": srv / batches * 1e6,
            "steps_per_message": steps / messages if messages else float("nan"),
        }


def loader_epochs(loader: Loader) -> Callable[[int], Iterable[Step]]:
    """A Loader's epochs for ``measure``: epoch ``e`` is the Loader after ``set_epoch(e)``."""

    def epoch(e: int) -> Iterable[Step]:
        loader.set_epoch(e)
        return loader

    return epoch


def measure_together(rows: dict[str, Contender], repeats: int = 3) -> dict[str, dict[str, float]]:
    """Each row's best of ``repeats`` epochs after a warm-up one, the rows' epochs taken in
    turn (row A's epoch 1, row B's epoch 1, A's epoch 2, ...), so that a change in the
    machine's load lands on every row alike instead of on whichever ran last."""
    for c in rows.values():
        c.warm()
    best: dict[str, dict[str, float]] = {name: {} for name in rows}
    for e in range(1, repeats + 1):
        for name, c in rows.items():
            row = c.run(e)
            if row["samples_s"] > best[name].get("samples_s", 0.0):
                best[name] = row
    return best


def measure(
    epoch: Callable[[int], Iterable[Step]],
    per_step: int,
    server: int | None = None,
    repeats: int = 3,
    loader: Loader | None = None,
) -> dict[str, float]:
    """Samples/s, trainer CPU and server CPU per batch (and a Loader's steps per message):
    the best of ``repeats`` epochs after a warm-up epoch (the machine is shared: the best
    epoch is the least disturbed one)."""
    return measure_together({"": Contender(epoch, per_step, server, loader)}, repeats)[""]
