"""The credit a Loader grants (``prefetch=``): its check and its default from the dataset."""

from __future__ import annotations

from shardserve.proto.api import DatasetInfo
from shardserve.proto.errors import BadRequest
from shardserve.proto.messages import GROUP_BYTES, MAX_CREDIT

#: ``prefetch=None`` grants credit for about this many bytes of small batches: two messages
#: of ``GROUP_BYTES`` (see :func:`auto_prefetch`).
AUTO_PREFETCH_BYTES = 2 * GROUP_BYTES


def auto_prefetch(info: DatasetInfo, batch_size: int, sample_bytes: float | None = None) -> int:
    """``prefetch=None``: 4 batches, or as many as about ``AUTO_PREFETCH_BYTES`` of samples
    hold (at most 64), so that small batches travel several to a message with one message in
    flight while the loop reads another. ``sample_bytes``: a sample as the job serves it
    (after its transforms, from the server); the stored size when ``None``.

    >>> info = DatasetInfo(name="c", num_samples=1000, num_shards=1, bytes=3_000_000, fields=[])
    >>> auto_prefetch(info, 32), auto_prefetch(info, 4096), auto_prefetch(info, 32, 12_000.0)
    (64, 4, 21)
    """
    per_sample = info.bytes / max(info.num_samples, 1) if sample_bytes is None else sample_bytes
    batch_bytes = per_sample * batch_size
    return int(max(4, min(64, AUTO_PREFETCH_BYTES // max(batch_bytes, 1))))


def check_prefetch(prefetch: int | None) -> None:
    if prefetch is not None and not 1 <= prefetch <= MAX_CREDIT:
        raise BadRequest(f"prefetch={prefetch} is out of range 1 <= prefetch <= {MAX_CREDIT}")
