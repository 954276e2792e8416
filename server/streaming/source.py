"""What streaming reads a batch from: the store's datasets, typed at the seam.

``Dataset`` (mapped files), ``RemoteDataset`` (object storage through the cache) and
``GraphCollated`` (a wrapper that collates graphs) all fit :class:`BatchSource`; streaming
depends on this protocol, not on which of them it was given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from shardserve.proto.manifest import Manifest

#: A batch as the store returns it: part name -> array, in frame order.
BatchParts = dict[str, np.ndarray]
#: Part name -> ``(dtype, per-sample shape)`` for fixed-size parts, ``None`` for variable ones.
PartShapes = Mapping[str, "tuple[str, tuple[int, ...]] | None"]


class BatchSource(Protocol):
    """A dataset as streaming uses it (thread-safe: ``take`` runs on assembly workers)."""

    @property
    def manifest(self) -> Manifest: ...

    @property
    def shard_rows(self) -> np.ndarray: ...

    def part_shapes(self, fields: Sequence[str] | None = None) -> PartShapes: ...

    def take(
        self,
        indices: np.ndarray | Sequence[int],
        fields: Sequence[str] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> BatchParts: ...
