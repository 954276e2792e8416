"""Server-side transforms: the per-sample work DataLoader workers did, done in the
sidecar, seeded per sample, deterministic and resumable.

Writing one::

    from shardserve.server.transforms import Field, sample_transform

    @sample_transform(outputs={"label": Field("int64", ())})
    def shift(sample, params, rng):
        return {"label": sample["label"] + 1}

Modules: :mod:`.registry` (marking, loading), :mod:`.spec` (checking a job's chain),
:mod:`.rng` (generators), :mod:`.runner` (running a chain), :mod:`.pool` (threads or worker
processes, deadlines), :mod:`.bound` (a stream's dataset with its chain), :mod:`.builtins`
and :mod:`.images` (the built-ins), :mod:`.errors`, :mod:`.metrics`.
"""

from shardserve.proto.errors import TransformError

from .registry import batch_transform, sample_transform
from .schema import Field

__all__ = ["Field", "TransformError", "batch_transform", "sample_transform"]
