"""A source's whole columns (``ShardWriter.add_batch``) made ready for the column buffers.

A fixed field arrives as one array ``[B, *shape]`` (a masked array marks missing rows), raw
bytes from a columnar source as an Arrow array (kept as is: no object per row), anything
else as a sequence of per-sample values with ``None`` for a missing one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from .columns import BinaryColumn, Column, FixedColumn


def checked_column(c: Column, raw: object, b: int, where: str) -> tuple[Any, np.ndarray | None]:
    """``raw`` (``b`` rows) checked against the buffer ``c``, and which rows are missing
    (``None``: none known to be)."""
    missing: np.ndarray | None = None
    if isinstance(c, FixedColumn):
        if isinstance(raw, np.ma.MaskedArray):
            m = np.asarray(np.ma.getmaskarray(raw))
            missing = np.asarray(m.reshape(len(m), -1).any(axis=1) if m.ndim > 1 else m)
            raw = raw.filled(0)
        return c.check_column(raw, b, where), missing
    if isinstance(raw, pa.Array) and isinstance(c, BinaryColumn):
        if raw.null_count:
            missing = raw.is_null().to_numpy(zero_copy_only=False)
        return raw, missing
    items: Any = raw
    col = [None if v is None else c.check(v, f"{where} row {j}") for j, v in enumerate(items)]
    if any(v is None for v in col):
        missing = np.fromiter((v is None for v in col), dtype=bool, count=b)
    return col, missing


def first_value(col: Any) -> object:
    """The first value of a column that is there (a missing one says nothing of the type)."""
    if isinstance(col, np.ma.MaskedArray):
        return col.data[0]
    if isinstance(col, pa.Array):  # Arrow bytes (columnar sources): its type says binary
        return b""
    if isinstance(col, np.ndarray):
        return col[0]
    return next((v for v in col if v is not None), None)
