"""Read a folder of ``.pt`` files: one sample per file, or many.

What a file may hold (tensors become numpy arrays; numbers, bytes, str and ``None`` stay):

* a sample: a dict nested to any depth, a tuple (``(image, label)``) or a bare tensor;
* a **list** of samples (a "chunked .pt" file): one sample per element, in order;
* with ``stacked=True`` (``--stacked``), a dict of tensors sharing a leading dimension: one
  sample per row;
* a ``torch_geometric`` ``Data`` / ``HeteroData`` (or a list of them): read through
  :mod:`.pyg` without PyG's classes (see there), a ``Data`` as a dict of its tensors plus
  ``num_nodes``;
* a ``torch_geometric`` ``InMemoryDataset`` file (``processed/data.pt``): one sample per
  graph, as ``dataset[i]`` gives it (:func:`.pyg.in_memory`).

Sparse tensors are refused (save them dense), as is a ``num_nodes`` that cannot be right.

torch is imported here and only here, lazily inside :func:`_torch`: ingest needs it to
read ``.pt`` files, while the serve path (the rest of ``shardserve.server``) must never
import it. Files are loaded with ``torch.load(weights_only=True, map_location="cpu")``:
never unpickled, so a file holding arbitrary Python objects is refused, not executed.

Loading runs in a bounded thread pool (``torch.load`` releases the GIL for its file reads);
results are yielded in sorted file order, so an ingest is deterministic.
"""

from __future__ import annotations

import importlib
import io
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from types import ModuleType
from typing import TypeAlias

import numpy as np

from shardserve.proto.errors import InvalidDataError

from . import pyg
from .source import IngestSource, Piece, Reader, require_files, source_files

SUFFIXES = (".pt", ".pth")

#: How long one file may take to load before ingest gives up on it.
LOAD_TIMEOUT_S = 300.0


def _torch() -> ModuleType:
    # Lazy on purpose: only `.pt` ingest needs torch; the server must run without it.
    return importlib.import_module("torch")


def _to_value(torch: ModuleType, path: Path | str, key: str, value: object) -> object:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.layout != torch.strided:
            raise InvalidDataError(
                f"{path}: field {key!r} is a {t.layout} tensor, which the store cannot hold; "
                "save it dense (tensor.to_dense()) or as its index and value tensors"
            )
        if t.dtype == torch.bfloat16:
            raise InvalidDataError(
                f"{path}: field {key!r} is bfloat16, which the store cannot hold; convert it to float32"
            )
        return t.cpu().numpy()
    if value is None or isinstance(
        value, (bool, int, float, bytes, bytearray, str, np.ndarray, np.generic)
    ):
        return value
    if isinstance(value, dict):
        return {
            k: _to_value(torch, path, f"{key}.{k}" if key else str(k), v) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        items = [_to_value(torch, path, f"{key}[{i}]", v) for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    if pyg.is_stub(value):
        return _to_value(torch, path, key, pyg.as_sample(value, path))
    raise InvalidDataError(
        f"{path}: field {key!r} holds a {type(value).__name__}; a sample must hold tensors, "
        "numbers, bytes, None, and dicts / tuples / lists of them"
    )


def load_file(path: Path | str, data: bytes | None = None) -> object:
    """One ``.pt`` file's object (or ``data``, a ``.pt`` file's bytes, named ``path`` in
    errors), tensors as numpy arrays (see module docstring)."""
    torch = _torch()
    try:
        with pyg.standins(torch):
            src: io.BytesIO | Path | str = io.BytesIO(data) if data is not None else path
            obj = torch.load(src, weights_only=True, map_location="cpu")
            graphs = pyg.in_memory(obj, path)
    except InvalidDataError:
        raise
    except Exception as e:  # torch raises many types for unreadable files
        if isinstance(e, EOFError) and not str(e):  # torch's word for an empty file
            raise InvalidDataError(
                f"{path}: torch.load failed: the file ends before any object (is it empty, or "
                "cut short while being written?)"
            ) from None
        if type(e).__name__ != "UnpicklingError":
            raise InvalidDataError(f"{path}: torch.load failed: {type(e).__name__}: {e}") from None
        # weights_only refused a pickled object; matched by name so no pickle module is imported here.
        text = str(e).strip()
        first = next(
            (ln for ln in text.splitlines() if "GLOBAL" in ln),
            text.splitlines()[0] if text else type(e).__name__,
        )
        raise InvalidDataError(
            f"{path}: refused: it holds pickled Python objects that torch.load(weights_only=True) "
            "will not load (unpickling them could run arbitrary code); save dicts, tuples or "
            f"lists of tensors and numbers instead ({first.strip()})"
        ) from None
    if graphs is not None:
        return [_to_value(torch, f"{path} graph {i}", "", g) for i, g in enumerate(graphs)]
    return _to_value(torch, path, "", obj)


def load_sample(path: Path) -> object:
    """One ``.pt`` file as one sample (kept for callers that read a single sample)."""
    return load_file(path)


def split_samples(obj: object, path: Path, stacked: bool) -> list[object]:
    """The samples a file's object holds: a list's elements, a stacked dict's rows, or itself."""
    if isinstance(obj, list):
        return obj
    if stacked:
        if not isinstance(obj, dict):
            raise InvalidDataError(
                f"{path}: --stacked expects a dict of tensors sharing a leading dimension, "
                f"but the file holds a {type(obj).__name__}"
            )
        return _rows(obj, path)
    return [obj]


#: A ``--stacked`` file's dict once checked: arrays sharing a leading dimension, nested.
_Stacked: TypeAlias = "dict[str, _Stacked | np.ndarray]"


def _rows(obj: dict[str, object], path: Path) -> list[object]:
    lengths: dict[str, int] = {}

    def walk(d: dict[str, object], prefix: str) -> _Stacked:
        out: _Stacked = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out[k] = walk(v, f"{prefix}{k}.")
            elif isinstance(v, np.ndarray) and v.ndim:
                lengths[prefix + str(k)] = v.shape[0]
                out[k] = v
            else:
                raise InvalidDataError(
                    f"{path}: --stacked: {prefix}{k} is not a tensor with a leading sample dimension"
                )
        return out

    stacked = walk(obj, "")
    if len(set(lengths.values())) != 1:
        raise InvalidDataError(
            f"{path}: --stacked needs one leading length for every tensor; lengths are {lengths}"
        )
    n = next(iter(lengths.values()))

    def row(d: _Stacked, i: int) -> dict[str, object]:
        return {k: row(v, i) if isinstance(v, dict) else v[i] for k, v in d.items()}

    return [row(stacked, i) for i in range(n)]


def _load_pieces(path: Path, stacked: bool) -> list[Piece]:
    # Runs in a loader thread: the stat stays off the writer's (main) thread.
    obj = load_file(path)
    samples = split_samples(obj, path, stacked)
    size = path.stat().st_size
    many = isinstance(obj, list) or stacked
    pieces = [
        Piece(where=f"{path} sample {i}" if many else str(path), sample=s)
        for i, s in enumerate(samples)
    ]
    if not pieces:
        return [Piece(where=str(path), files=1, nbytes=size)]
    pieces[-1].files, pieces[-1].nbytes = 1, size
    return pieces


def _pieces(files: list[Path], threads: int, stacked: bool) -> Iterator[Piece]:
    # The stand-ins are held for the whole source: registering them per file costs more
    # than a small file's load.
    with pyg.standins(_torch()):
        yield from _loaded(files, threads, stacked)


def _loaded(files: list[Path], threads: int, stacked: bool) -> Iterator[Piece]:
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ingest-pt")
    pending: deque[tuple[Path, Future[list[Piece]]]] = deque()
    todo = iter(files)
    window = 4 * threads
    try:
        while True:
            while len(pending) < window and (path := next(todo, None)) is not None:
                pending.append((path, pool.submit(_load_pieces, path, stacked)))
            if not pending:
                return
            path, fut = pending.popleft()
            try:
                pieces = fut.result(timeout=LOAD_TIMEOUT_S)
            except FutureTimeout:
                raise InvalidDataError(
                    f"{path}: torch.load did not finish within {LOAD_TIMEOUT_S:.0f} s"
                ) from None
            yield from pieces
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def open_pt(
    src: Path, threads: int = 2, stacked: bool = False, only: list[Path] | None = None
) -> IngestSource:
    """A source of the samples of the ``.pt`` files under ``src`` (see module docstring)."""
    _torch()  # fail early, before any file is read, if torch is not installed
    files = require_files(source_files(src, SUFFIXES, only), src, ".pt")
    return IngestSource(format="pt", files=files, pieces=_pieces(files, max(1, threads), stacked))


READER = Reader("pt", open_pt, suffixes=SUFFIXES)
