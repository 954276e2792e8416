"""What a Loader (or ``plan``) asks the server for: the job its arguments make, the checks of
those arguments, and the default credit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardserve.proto.api import DatasetInfo
from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import JobSpec, ShuffleMode
from shardserve.proto.messages import GROUP_BYTES, MAX_CREDIT

#: ``prefetch=None`` grants credit for about this many bytes of small batches: two messages
#: of ``GROUP_BYTES`` (see :func:`auto_prefetch`).
AUTO_PREFETCH_BYTES = 2 * GROUP_BYTES
#: What ``shuffle=`` accepts, and the job's shuffle mode for each.
SHUFFLE: dict[object, ShuffleMode] = {
    True: "global",
    False: "none",
    "global": "global",
    "block": "block",
    "none": "none",
}


def loader_spec(
    dataset: str,
    batch_size: int,
    *,
    seed: int,
    shuffle: bool | str,
    drop_last: bool,
    world_size: int,
    fields: Sequence[str] | None,
    collate: str | None,
    envs: int = 1,
    transforms: Sequence[Mapping[str, Any]] | None = None,
    on_error: str | None = None,
) -> JobSpec:
    """The job a ``Loader`` (or ``plan``) with these arguments streams; with ``envs > 1`` each
    of its batches is one step of ``envs`` batches of ``batch_size``."""
    return JobSpec.model_validate({
        "dataset": dataset, "batch_size": batch_size * envs, "seed": seed,
        "shuffle": SHUFFLE[shuffle], "drop_last": drop_last, "world_size": world_size,
        "fields": tuple(fields) if fields is not None else None,
        "collate": collate, "envs": envs,
        # Transforms installed on the server, named with JSON params (never code).
        "transforms": tuple(transforms) if transforms is not None else None,
        "on_error": on_error,
    })  # fmt: skip


def auto_prefetch(info: DatasetInfo, batch_size: int) -> int:
    """``prefetch=None``: 4 batches, or as many as about ``AUTO_PREFETCH_BYTES`` of stored
    samples hold (at most 64), so that small batches travel several to a message with one
    message in flight while the loop reads another.

    >>> info = DatasetInfo(name="c", num_samples=1000, num_shards=1, bytes=3_000_000, fields=[])
    >>> auto_prefetch(info, 32), auto_prefetch(info, 4096)
    (64, 4)
    """
    batch_bytes = info.bytes / max(info.num_samples, 1) * batch_size
    return int(max(4, min(64, AUTO_PREFETCH_BYTES // max(batch_bytes, 1))))


def check_args(shuffle: object, prefetch: int | None, timeout: float) -> None:
    if shuffle not in SHUFFLE:
        raise BadRequest(f"shuffle={shuffle!r}: use True, False, 'global', 'block' or 'none'")
    if prefetch is not None and not 1 <= prefetch <= MAX_CREDIT:
        raise BadRequest(f"prefetch={prefetch} is out of range 1 <= prefetch <= {MAX_CREDIT}")
    if not timeout > 0:
        raise BadRequest(f"timeout={timeout} must be a positive number of seconds")
