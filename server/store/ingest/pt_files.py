"""Read a folder of ``.pt`` files, one sample per file (a dict of tensors / numbers / bytes).

torch is imported here and only here, lazily inside :func:`_torch`: ingest needs it to
read ``.pt`` files, while the serve path (the rest of ``shardserve.server``) must never
import it. Files are loaded with ``torch.load(weights_only=True, map_location="cpu")``:
never unpickled, so a file holding arbitrary Python objects is refused, not executed.

Loading runs in a bounded thread pool (``torch.load`` releases the GIL for its file reads);
results are yielded in sorted file order, so an ingest is deterministic.
"""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from shardserve.proto.errors import InvalidDataError

from .registry import SUFFIXES
from .source import Piece, Source, list_files, require_files

#: How long one file may take to load before ingest gives up on it.
LOAD_TIMEOUT_S = 300.0


def _torch() -> ModuleType:
    # Lazy on purpose: only `.pt` ingest needs torch; the server must run without it.
    return importlib.import_module("torch")


def _to_value(torch: ModuleType, path: Path, key: str, value: Any) -> object:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.dtype == torch.bfloat16:
            raise InvalidDataError(
                f"{path}: field {key!r} is bfloat16, which the store cannot hold; convert it to float32"
            )
        return t.cpu().numpy()
    if isinstance(value, (bool, int, float, bytes, bytearray, str, np.ndarray, np.generic)):
        return value
    raise InvalidDataError(
        f"{path}: field {key!r} holds a {type(value).__name__}; a sample must be a dict of "
        "tensors, numbers or bytes"
    )


def load_sample(path: Path) -> dict[str, object]:
    """One ``.pt`` file as a dict of numpy arrays / numbers / bytes."""
    torch = _torch()
    try:
        obj = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises many types for unreadable files
        if type(e).__name__ != "UnpicklingError":
            raise InvalidDataError(f"{path}: torch.load failed: {type(e).__name__}: {e}") from None
        # weights_only refused a pickled object; matched by name so no pickle module is imported here.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InvalidDataError(
            f"{path}: refused: it holds pickled Python objects that torch.load(weights_only=True) "
            "will not load (unpickling them could run arbitrary code); save a dict of tensors "
            f"and numbers instead ({first})"
        ) from None
    if isinstance(obj, torch.Tensor):
        obj = {"data": obj}
    if not isinstance(obj, dict):
        raise InvalidDataError(
            f"{path}: holds a {type(obj).__name__}; expected a dict of tensors (one sample)"
        )
    return {str(k): _to_value(torch, path, str(k), v) for k, v in obj.items()}


def _load_piece(path: Path) -> Piece:
    # Runs in a loader thread: the stat stays off the writer's (main) thread.
    return Piece(where=str(path), sample=load_sample(path), files=1, nbytes=path.stat().st_size)


def _pieces(files: list[Path], threads: int) -> Iterator[Piece]:
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ingest-pt")
    pending: deque[tuple[Path, Future[Piece]]] = deque()
    todo = iter(files)
    window = 4 * threads
    try:
        while True:
            while len(pending) < window and (path := next(todo, None)) is not None:
                pending.append((path, pool.submit(_load_piece, path)))
            if not pending:
                return
            path, fut = pending.popleft()
            try:
                piece = fut.result(timeout=LOAD_TIMEOUT_S)
            except FutureTimeout:
                raise InvalidDataError(
                    f"{path}: torch.load did not finish within {LOAD_TIMEOUT_S:.0f} s"
                ) from None
            yield piece
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def open_pt(src: Path, threads: int = 2) -> Source:
    """A source of one sample per ``.pt`` file under ``src``."""
    _torch()  # fail early, before any file is read, if torch is not installed
    files = require_files(list_files(src, SUFFIXES["pt"]), src, ".pt")
    return Source(format="pt", files=files, pieces=_pieces(files, max(1, threads)))
