"""Arrays to and from a worker process without pickle: a JSON header frame, then one raw
frame per array, over a ``multiprocessing`` connection's ``send_bytes``/``recv_bytes``.

Frame layout::

    frame 0: UTF-8 JSON {"meta": {...}, "arrays": [{"name", "dtype", "shape"}, ...]}
    frame 1..n: the raw C-order bytes of each array, in header order
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import numpy as np


def send(conn: Connection, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    arrs = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    head = {
        "meta": dict(meta),
        "arrays": [
            {"name": k, "dtype": v.dtype.str, "shape": list(v.shape)} for k, v in arrs.items()
        ],
    }
    conn.send_bytes(json.dumps(head).encode())
    for v in arrs.values():
        conn.send_bytes(v.reshape(-1).view(np.uint8).data if v.size else b"")


def recv(conn: Connection) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    head = json.loads(conn.recv_bytes())
    arrays: dict[str, np.ndarray] = {}
    for a in head["arrays"]:
        dt = np.dtype(a["dtype"])
        if dt.hasobject:
            raise ValueError(f"array {a['name']!r} has object dtype; refused")
        data = conn.recv_bytes()
        arrays[a["name"]] = np.frombuffer(data, dtype=dt).reshape(a["shape"])
    return head["meta"], arrays
