"""Running a chain on one batch: pure, the same on a thread and in a worker process.

Input and output are batch *parts* in the store's layout (fixed field ``x`` ``[B, ...]``;
variable ``x`` values + ``x.offsets`` + ``x.shapes``; binary ``x`` bytes + ``x.offsets``).
In between, a field is a ``[B, ...]`` array (fixed) or a list of per-sample arrays.
Every output is checked against its declaration; a mismatch names the field and both shapes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from shardserve.proto.parts import OFFSETS, SHAPES

from ..source import FRESH, Tail
from .errors import StepFailed
from .keys import SampleKeys
from .rng import CURRENT_SCHEME, LEGACY_SCHEME, batch_rng, sample_rngs
from .schema import Field
from .spec import Chain, Step

Column = np.ndarray | list[np.ndarray]


@dataclass(frozen=True, slots=True)
class Limits:
    """What a chain may make the server hold, from settings: the bytes of one batch's
    variable-size outputs, and the pixels of one decoded image (read from its header)."""

    max_batch_bytes: int = 1 << 30
    max_decoded_pixels: int = 1 << 26


@dataclass(slots=True)
class Progress:
    """Which step a piece is running: read when it missed its deadline, to name the one
    transform that hung."""

    step: str = ""


@dataclass(frozen=True, slots=True)
class Where:
    """Which batch this is: everything the generators are derived from, and by which
    randomness scheme (:data:`~.rng.SCHEMES`)."""

    seed: int
    epoch: int
    rank: int
    batch: int
    scheme: int = CURRENT_SCHEME


def split_parts(parts: Mapping[str, np.ndarray], schema: Mapping[str, Field]) -> dict[str, Column]:
    """Store-layout parts -> columns (fixed arrays stay views; ragged become per-sample views)."""
    cols: dict[str, Column] = {}
    for name, f in schema.items():
        if name not in parts:
            continue
        values = parts[name]
        if f.fixed:
            cols[name] = values
            continue
        offsets = parts[name + OFFSETS]
        shapes = parts.get(name + SHAPES)
        items = []
        for i in range(len(offsets) - 1):
            v = values[int(offsets[i]) : int(offsets[i + 1])]
            items.append(v.reshape(tuple(int(d) for d in shapes[i])) if shapes is not None else v)
        cols[name] = items
    return cols


def join_parts(
    cols: Mapping[str, Column],
    schema: Mapping[str, Field],
    names: Sequence[str],
    out: Mapping[str, np.ndarray] | None = None,
    tail: Tail = FRESH,
) -> dict[str, np.ndarray]:
    """Columns -> store-layout parts of ``names`` (fixed ones written into ``out`` if it fits,
    the values of variable ones joined in ``tail``)."""
    parts: dict[str, np.ndarray] = {}
    for name in names:
        f, col = schema[name], cols[name]
        if f.fixed:
            arr = col if isinstance(col, np.ndarray) else _stack(col, f)
            dest = out.get(name) if out is not None else None
            # The last step may have written it in place already: then there is nothing to copy.
            if arr is not dest and dest is not None and _fits(dest, arr.shape, arr.dtype):
                np.copyto(dest, arr)
                arr = dest
            parts[name] = np.ascontiguousarray(arr)
            continue
        items = list(col)
        sizes = np.fromiter((a.size for a in items), dtype=np.int64, count=len(items))
        offsets = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        dt = np.dtype(f.dtype)
        flat = [a.reshape(-1) for a in items]
        parts[name] = (
            np.concatenate(flat, out=tail.empty(name, (int(offsets[-1]),), dt), casting="unsafe")
            if flat
            else np.empty(0, dt)
        )
        parts[name + OFFSETS] = offsets
        if not f.binary:
            parts[name + SHAPES] = np.array([a.shape for a in items], dtype=np.int64).reshape(
                len(items), len(f.shape)
            )
    return parts


def _fits(dest: np.ndarray, shape: tuple[int, ...], dtype: DTypeLike) -> bool:
    """Whether ``dest`` has exactly this shape and dtype (so a result can live there)."""
    return dest.shape == tuple(shape) and dest.dtype == dtype


def _stack(items: list[np.ndarray], f: Field) -> np.ndarray:
    return np.stack(items) if items else np.empty((0, *f.shape), dtype=f.dtype)


def _check(
    step: Step,
    name: str,
    f: Field,
    arr: object,
    position: int | None,
    index: int | None,
    batch: int | None,
) -> np.ndarray:
    t = step.transform.name
    if isinstance(arr, np.generic):  # a scalar field's value, e.g. sample["label"]
        arr = np.asarray(arr)
    if not isinstance(arr, np.ndarray):
        raise StepFailed(
            t,
            position,
            index,
            f"returned {type(arr).__name__} for field {name!r}, "
            f"declared a numpy array {f.describe()}",
            replaceable=False,
        )
    want = f if batch is None else Field(f.dtype, (batch, *f.shape))
    if not want.matches(arr):
        raise StepFailed(
            t,
            position,
            index,
            f"returned field {name!r} as {arr.dtype}{list(arr.shape)}, declared "
            f"{want.dtype}{list(want.shape)}",
            replaceable=False,
        )
    return arr


def _apply_sample(
    step: Step,
    si: int,
    cols: dict[str, Column],
    indices: np.ndarray,
    where: Where,
    limits: Limits,
    dest: Mapping[str, np.ndarray],
) -> None:
    t = step.transform
    n = len(indices)
    more = (limits,) if t.takes_limits else ()
    # Variable-size outputs are bounded as they come: the step stops at the first sample
    # that takes the batch's variable bytes past --max-batch-bytes.
    ragged = [k for k, f in step.writes.items() if not f.fixed]
    held = 0
    written: dict[str, list[np.ndarray]] = {k: [] for k in step.writes}
    names = list(cols)
    failed: StepFailed | None = None
    rngs = sample_rngs(where.seed, where.epoch, indices, si)
    for i in range(n):
        idx = int(indices[i])
        sample = {k: cols[k][i] for k in names}
        try:
            got = t.fn(sample, step.params, rngs[i], *more)
        except Exception as e:
            # Go on through the step: a replacing job then swaps every failing sample at once.
            if failed is None:
                failed = StepFailed(t.name, i, idx, f"{type(e).__name__}: {e}")
            else:
                failed.all.append((i, idx))
            continue
        if failed is not None:
            continue
        if not isinstance(got, Mapping) or set(got) - set(step.writes):
            extra = sorted(set(got) - set(step.writes)) if isinstance(got, Mapping) else got
            raise StepFailed(
                t.name,
                i,
                idx,
                f"returned {extra!r}; it declares only {sorted(step.writes)}",
                replaceable=False,
            )
        for k, f in step.writes.items():
            if k not in got:
                raise StepFailed(
                    t.name, i, idx, f"did not return declared field {k!r}", replaceable=False
                )
            written[k].append(_check(step, k, f, got[k], i, idx, None))
        if ragged:
            held += sum(written[k][-1].nbytes for k in ragged)
            if held > limits.max_batch_bytes:
                raise StepFailed(
                    t.name,
                    i,
                    idx,
                    f"variable-size output {ragged} reached {held} bytes at this sample, more "
                    f"than --max-batch-bytes {limits.max_batch_bytes} for one batch",
                    replaceable=False,
                )
    if failed is not None:
        raise failed
    for k, f in step.writes.items():
        if k in dest and written[k]:
            cols[k] = np.stack(written[k], out=dest[k])  # stacked where the batch is sent from
        else:
            cols[k] = _stack(written[k], f) if f.fixed else written[k]


def _keys(where: Where, step: int, indices: np.ndarray, legacy: bool) -> SampleKeys:
    """The keys of chain step ``step``'s draws for this batch (scheme 1: its old generator)."""
    old = batch_rng(where.seed, where.epoch, where.rank, where.batch, step) if legacy else None
    return SampleKeys(where.seed, where.epoch, step, indices, legacy=old)


def step_keys(where: Where, step: int, indices: np.ndarray) -> SampleKeys:
    """The keys chain step ``step`` draws from for samples ``indices`` of batch ``where``
    (in the job's scheme): what its kernel is given, wherever it runs."""
    return _keys(where, step, indices, where.scheme == LEGACY_SCHEME)


def _apply_batch(
    step: Step,
    at: tuple[int, ...],
    cols: dict[str, Column],
    indices: np.ndarray,
    where: Where,
    limits: Limits,
    dest: Mapping[str, np.ndarray],
) -> None:
    t = step.transform
    n = len(indices)
    legacy = where.scheme == LEGACY_SCHEME
    keyed = t.takes_keys and not legacy
    # A keyed step draws from its keys alone (~40 us a batch saved by not making this).
    rng = None if keyed else batch_rng(where.seed, where.epoch, where.rank, where.batch, at[0])
    more = (limits,) if t.takes_limits else ()
    into: dict[str, object] = {"out": dest} if t.takes_out else {}
    if t.takes_keys:
        # Scheme 1 keys carry the batch generator: the draws are then the old ones. A fused
        # step gets the keys of each step it runs, in order (see .fused).
        keys = [_keys(where, i, indices, legacy) for i in at]
        into["keys"] = keys[0] if len(at) == 1 else keys
    try:
        got = t.fn(dict(cols), step.params, rng, *more, **into)
    except StepFailed:  # a kernel's own, naming the samples it failed on
        raise
    except Exception as e:
        raise StepFailed(t.name, None, None, f"{type(e).__name__}: {e}") from e
    for k, f in step.writes.items():
        if not isinstance(got, Mapping) or k not in got:
            raise StepFailed(
                t.name, None, None, f"did not return declared field {k!r}", replaceable=False
            )
        cols[k] = _check(step, k, f, got[k], None, None, n)


def _dest(
    step: Step, chain: Chain, names: Sequence[str], n: int, out: Mapping[str, np.ndarray] | None
) -> dict[str, np.ndarray]:
    """The arrays of ``out`` the last step may write its fixed-size outputs into: only the
    fields served (``names``) whose array has exactly the declared shape and dtype. A sample
    step's outputs are stacked there by the runner; a batch step writes there itself only if
    it takes ``out=``. (An earlier step never gets them: a later one reads its outputs.)"""
    if out is None or (step.transform.shape == "batch" and not step.transform.takes_out):
        return {}
    dest = {}
    for name, f in step.writes.items():
        a = out.get(name)
        served = name in names and f.fixed and f == chain.outputs.get(name)
        if a is not None and served and _fits(a, (n, *f.shape), np.dtype(f.dtype)):
            dest[name] = a
    return dest


def run_chain(
    chain: Chain,
    parts: Mapping[str, np.ndarray],
    indices: np.ndarray,
    where: Where,
    names: Sequence[str],
    out: Mapping[str, np.ndarray] | None = None,
    limits: Limits | None = None,
    progress: Progress | None = None,
    tail: Tail = FRESH,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """``(parts of names, seconds per transform)``; raises :class:`StepFailed`.

    ``out``: where the fixed-size outputs go (the stream's memory); the last step writes the
    ones it produces there (see :func:`_dest`), the others are copied there at the end.
    ``tail``: where the variable-size outputs are joined."""
    cols = split_parts(parts, chain.inputs)
    spent: dict[str, float] = {}
    limits = limits or Limits()
    last = len(chain.steps) - 1
    for si, step in enumerate(chain.steps):
        if progress is not None:
            progress.step = step.transform.name
        t0 = time.perf_counter()
        dest = _dest(step, chain, names, len(indices), out) if si == last else {}
        at = step.origin or (si,)  # the step's position in the job's chain, before fusing
        if step.transform.shape == "sample":
            _apply_sample(step, at[0], cols, indices, where, limits, dest)
        else:
            _apply_batch(step, at, cols, indices, where, limits, dest)
        name = step.transform.name
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
    return join_parts(cols, chain.outputs, names, out, tail), spent
