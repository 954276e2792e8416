"""What one job may ask the data plane to allocate, checked before anything is allocated.

A batch is assembled into buffers sized for a full batch, so a job spec alone decides how
much memory its streams take: ``batch_size=2**20`` on a 100-sample dataset once made the
streamer thread ask for 64 GiB. Both checks run when the job is created (a 4xx naming the
bound) and again before a stream is planned (jobs journaled by an older server).

A ``batch_size`` larger than a rank's share of a small split is what a ``DataLoader`` with
``drop_last=False`` accepts: one short batch (padded across ranks as ``DistributedSampler``
pads), which is what the plan deals. Buffers are then sized by :func:`batch_rows`, the most
a batch can hold, never by the larger ``batch_size``.
"""

from __future__ import annotations

from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import JobSpec

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


def batch_rows(spec: JobSpec, num_samples: int) -> int:
    """The most samples one batch of ``spec`` over ``num_samples`` holds: ``batch_size``, or a
    rank's whole share (``ceil(num_samples / world_size)``, padding included) when that is
    smaller and ``drop_last`` is False. Steps of several environments keep ``batch_size``."""
    if spec.drop_last or spec.envs > 1:
        return spec.batch_size
    share = -(-num_samples // spec.world_size)
    return max(1, min(spec.batch_size, share))


def check_job_batch(spec: JobSpec, num_samples: int, sample_bytes: float, max_bytes: int) -> int:
    """:func:`check_batch` for a job of one dataset of ``num_samples`` samples of about
    ``sample_bytes`` each; returns :func:`batch_rows`."""
    rows = batch_rows(spec, num_samples)
    if spec.drop_last and spec.envs == 1 and spec.batch_size > max(num_samples, 1):
        raise BadRequest(
            f"batch_size {spec.batch_size} is larger than the dataset ({num_samples} samples): "
            f"with drop_last=True no batch is left; use batch_size <= {num_samples}, or "
            "drop_last=False for one short batch (as a DataLoader gives)"
        )
    check_batch(rows, num_samples, int(sample_bytes * rows), max_bytes)
    return rows
