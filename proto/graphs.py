"""What both sides know of ``collate="graph"`` batches. Pure functions.

Following ``torch_geometric``, a field whose last name segment contains ``index``
(``edge_index``) or is ``face`` holds node numbers and is concatenated along its **last**
dimension; every other part along its first. A message of several graph batches
carries a :data:`SPLITS` part: row ``f`` holds where each batch begins in the ``f``-th other
part, along that part's :func:`concat_dim`.

>>> concat_dim("edge_index"), concat_dim("mol.face"), concat_dim("x")
(-1, -1, 0)
"""

from __future__ import annotations

from .parts import SPLITS

__all__ = ["SPLITS", "concat_dim", "is_index_field"]


def is_index_field(name: str) -> bool:
    """Whether a field holds node numbers (shifted per graph, joined along its last dim)."""
    last = name.rsplit(".", 1)[-1]
    return "index" in last or last == "face"


def concat_dim(name: str) -> int:
    """The dimension along which a graph batch joins ``name``'s per-graph values."""
    return -1 if is_index_field(name) else 0
