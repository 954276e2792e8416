"""``--map module:function``: a user function over each source sample, before writing.

The place for expensive deterministic conversions (crystal structure -> graph) done once at
ingest rather than every epoch. The function gets one sample as the reader made it (dicts /
tuples of numpy arrays, numbers, bytes) and returns one sample, or ``None`` to drop it.
Block sources (npz, Parquet...) are handed over row by row.

``workers=N`` runs it in N processes (``spawn``: no fork of a process with threads), a
bounded window of samples ahead, results taken in source order, so the dataset is the same
whatever N. Samples cross to the workers by multiprocessing's own pickling between this
command's processes; nothing read from the source is unpickled. A failure names the file and
sample and what the function raised.
"""

from __future__ import annotations

import importlib
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager

import pyarrow as pa

from shardserve.proto.errors import InvalidDataError

from .source import Piece

#: The user's ``--map`` function: a sample in, a sample out (checked as any sample is).
MapFn = Callable[[object], object]
#: How long one sample may take in the function before ingest gives up.
MAP_TIMEOUT_S = 600.0
#: Samples handed to each worker at once, and samples in flight per worker.
CHUNK = 16
WINDOW_PER_WORKER = 4 * CHUNK


def resolve_map(spec: str) -> MapFn:
    """The function named ``module:function`` (importable where ingest runs)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise InvalidDataError(
            f"--map {spec!r}: expected MODULE:FUNCTION, e.g. mypkg.convert:to_graph"
        )
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise InvalidDataError(
            f"--map {spec!r}: cannot import {mod_name!r} ({e}); it must be importable where "
            "ingest runs: a module in the current directory, an installed package, or a folder "
            "on PYTHONPATH"
        ) from None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise InvalidDataError(f"--map {spec!r}: {mod_name} has no function {attr!r}")
    return fn


def _samples(pieces: Iterator[Piece]) -> Iterator[Piece]:
    """Pieces of one sample each (block pieces split into rows), bookkeeping kept."""
    for p in pieces:
        if p.columns is None:
            yield p
            continue
        cols = {k: v.to_pylist() if isinstance(v, pa.Array) else v for k, v in p.columns.items()}
        n = len(next(iter(cols.values()))) if cols else 0  # type: ignore[arg-type]
        for i in range(n):
            last = i == n - 1
            yield Piece(
                where=f"{p.where} row {i}",
                sample={k: v[i] for k, v in cols.items()},  # type: ignore[index]
                files=p.files if last else 0,
                nbytes=p.nbytes if last else 0,
            )
        if n == 0:
            yield Piece(where=p.where, files=p.files, nbytes=p.nbytes)


def _call(fn: MapFn, samples: list[tuple[str, object]]) -> list[tuple[bool, object]]:
    """Run in a worker: ``(True, result)`` or ``(False, message)`` per sample."""
    out: list[tuple[bool, object]] = []
    for _where, s in samples:
        try:
            out.append((True, fn(s)))
        except Exception as e:  # the user's function: report, do not crash the pool
            out.append((False, f"{type(e).__name__}: {e}"))
    return out


def _result(piece: Piece, ok: bool, value: object, name: str) -> Piece:
    if not ok:
        raise InvalidDataError(f"{piece.where}: --map {name} failed: {value}")
    return Piece(where=piece.where, sample=value, files=piece.files, nbytes=piece.nbytes)


def _inline(pieces: Iterator[Piece], fn: MapFn, name: str) -> Iterator[Piece]:
    for p in _samples(pieces):
        if p.sample is None:
            yield p
            continue
        ((ok, value),) = _call(fn, [(p.where, p.sample)])
        yield _result(p, ok, value, name)


def _pooled(
    pool: ProcessPoolExecutor, pieces: Iterator[Piece], fn: MapFn, name: str, workers: int
) -> Iterator[Piece]:
    pending: deque[tuple[list[Piece], Future[list[tuple[bool, object]]]]] = deque()
    todo = _samples(pieces)
    window = workers * WINDOW_PER_WORKER // CHUNK
    done = False
    while True:
        while not done and len(pending) < window:
            group: list[Piece] = []
            for p in todo:
                group.append(p)
                if len(group) == CHUNK:
                    break
            else:
                done = True
            if group:
                args = [(p.where, p.sample) for p in group if p.sample is not None]
                pending.append((group, pool.submit(_call, fn, args)))
        if not pending:
            return
        group, fut = pending.popleft()
        try:
            results = iter(fut.result(timeout=MAP_TIMEOUT_S))
        except FutureTimeout:
            raise InvalidDataError(
                f"{group[0].where}: --map {name} did not finish {len(group)} samples within "
                f"{MAP_TIMEOUT_S:.0f} s"
            ) from None
        except Exception as e:  # a worker died, or the function could not be sent to it
            raise InvalidDataError(
                f"{group[0].where}: --map {name}: worker failed: {type(e).__name__}: {e}"
            ) from None
        for p in group:
            if p.sample is None:
                yield p
            else:
                ok, value = next(results)
                yield _result(p, ok, value, name)


def _drop_none(pieces: Iterator[Piece]) -> Iterator[Piece]:
    for p in pieces:
        if p.sample is None and p.columns is None and not (p.files or p.nbytes):
            continue
        yield p


@contextmanager
def mapped(
    pieces: Iterator[Piece], fn: MapFn | None, name: str, workers: int
) -> Iterator[Iterator[Piece]]:
    """``pieces`` with ``fn`` applied to each sample (see module docstring)."""
    if fn is None:
        yield pieces
        return
    if workers <= 0:
        yield _drop_none(_inline(pieces, fn, name))
        return
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    try:
        yield _drop_none(_pooled(pool, pieces, fn, name, workers))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
