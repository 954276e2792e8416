"""What one job may ask the data plane to allocate, checked before anything is allocated.

A batch is assembled into buffers sized for a full batch, so a job spec alone decides how
much memory its streams take: ``batch_size=2**20`` on a 100-sample dataset once made the
streamer thread ask for 64 GiB. Both checks run when the job is created (a 4xx naming the
bound) and again before a stream is planned (jobs journaled by an older server).
"""

from __future__ import annotations

from shardserve.proto.errors import BadRequest

#: Default of ``--max-batch-bytes``.
DEFAULT_MAX_BATCH_BYTES = 1 << 30


class StreamCancelled(Exception):
    """Planning skipped: the stream was replaced or closed before its turn."""


def check_batch(batch_size: int, num_samples: int, batch_bytes: int, max_bytes: int) -> None:
    """Raise ``BadRequest`` unless a batch fits the dataset and the byte limit."""
    if batch_size > max(num_samples, 1):
        raise BadRequest(
            f"batch_size {batch_size} is larger than the dataset ({num_samples} samples): "
            f"use batch_size <= {num_samples}"
        )
    if batch_bytes > max_bytes:
        raise BadRequest(
            f"a batch of {batch_size} samples is about {batch_bytes} bytes, over the server's "
            f"{max_bytes}-byte limit (--max-batch-bytes): lower batch_size or raise the limit"
        )
