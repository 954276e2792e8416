"""Functions for ``--map`` tests (importable by name, as a user's module would be)."""

from __future__ import annotations

import numpy as np


def to_graph(sample: dict) -> dict:
    """A 'crystal' (positions) to a graph: edges between atoms closer than 1.0."""
    pos = np.asarray(sample["pos"], dtype=np.float32)
    d = np.linalg.norm(pos[:, None, :] - pos[None, :, :], axis=-1)
    src, dst = np.nonzero((d < 1.0) & (d > 0))
    return {"pos": pos, "edge_index": np.stack([src, dst]).astype(np.int64), "id": sample["id"]}


def fail_on_seven(sample: dict) -> dict:
    if int(sample["id"]) == 7:
        raise ValueError("bad crystal")
    return sample


def drop_odd(sample: dict) -> dict | None:
    return None if int(sample["id"]) % 2 else sample
