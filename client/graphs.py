"""Graph batches: what ``Loader(..., collate="graph")`` yields, and a PyG view of it.

With ``collate="graph"`` the server sends each batch already collated for message passing
(see ``shardserve.server.store.read.graphs``): node fields concatenated (``x [sum N, F]``),
``edge_index [2, sum E]`` with node offsets added, ``batch [sum N]`` and ``ptr [B+1]``; the
same tensors ``torch_geometric.loader.DataLoader`` would give for the same graphs.
:func:`to_pyg` wraps them in a ``torch_geometric.data.Batch`` for code written against PyG
(PyG is optional: only this function needs it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def to_pyg(batch: Mapping[str, Any]) -> Any:
    """A ``torch_geometric.data.Batch`` holding ``batch``'s tensors (no copy).

    Raises ``ImportError`` naming the package when PyG is not installed.
    """
    try:
        from torch_geometric.data import Batch
    except ImportError as e:
        raise ImportError(
            "to_pyg needs torch_geometric (pip install torch_geometric); the graph batch "
            "itself is a plain dict of tensors and needs nothing"
        ) from e
    if "batch" not in batch or "ptr" not in batch:
        raise ValueError(
            "to_pyg expects a graph batch (Loader(..., collate='graph')) with 'batch' and 'ptr'"
        )
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    out = Batch(**tensors)
    out._num_graphs = int(tensors["ptr"].numel()) - 1
    return out
