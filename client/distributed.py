"""Where this process sits in a distributed job: rank, world size, local device index.

Explicit arguments win; else an initialised ``torch.distributed`` process group; else the
``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` variables that ``torchrun`` sets; else a single
process (0 of 1).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch

from shardserve.proto.errors import BadRequest, ShardserveError

#: Bytes of the text ranks agree on (:func:`agree_with_rank0`): a job id and a version.
AGREE_BYTES = 128


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    #: Index of this process's device on its host (``LOCAL_RANK``), used for ``device="cuda"``.
    local_rank: int
    #: Where the numbers came from: "explicit", "torch.distributed", "env" or "default".
    source: str


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"environment variable {name}={raw!r} is not an integer") from None


def resolve_world(
    rank: int | None = None, world_size: int | None = None, env: Mapping[str, str] | None = None
) -> World:
    """This process's rank and world size.

    >>> resolve_world(1, 4, env={})
    World(rank=1, world_size=4, local_rank=1, source='explicit')
    >>> resolve_world(env={"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    World(rank=3, world_size=8, local_rank=1, source='env')
    >>> resolve_world(env={"RANK": "1"})
    Traceback (most recent call last):
    ...
    shardserve.proto.errors.BadRequest: environment variable RANK='1' is set but WORLD_SIZE is not: set both (as torchrun does), or pass rank= and world_size= to the Loader
    """
    env = os.environ if env is None else env
    local = _env_int(env, "LOCAL_RANK")
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise BadRequest(
                f"give both rank and world_size or neither (rank={rank}, world_size={world_size})"
            )
        r, w, source = rank, world_size, "explicit"
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        r, w, source = (
            torch.distributed.get_rank(),
            torch.distributed.get_world_size(),
            "torch.distributed",
        )
    else:
        er, ew = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
        if er is None and ew is None:
            r, w, source = 0, 1, "default"
        elif er is None or ew is None:
            # Half of the pair would make every such process rank 0 of 1: each would read
            # the whole epoch.
            have, lack = ("RANK", "WORLD_SIZE") if er is not None else ("WORLD_SIZE", "RANK")
            raise BadRequest(
                f"environment variable {have}={env[have]!r} is set but {lack} is not: set both "
                "(as torchrun does), or pass rank= and world_size= to the Loader"
            )
        else:
            r, w, source = er, ew, "env"
    if w < 1 or not 0 <= r < w:
        raise BadRequest(f"rank {r} is out of range 0 <= rank < world_size={w} (from {source})")
    return World(r, w, local if local is not None else (r if source == "explicit" else 0), source)


def agree_with_rank0(text: str, timeout: float) -> str:
    """Rank 0's ``text`` on every rank of the initialised default process group.

    Sent as a fixed-size uint8 tensor (``broadcast``), never pickled; every rank must call
    this, in the same order. Waits at most ``timeout`` seconds for the other ranks.

    A single process (no group) gets its own ``text`` back:

    >>> agree_with_rank0("job:version", timeout=1.0)
    'job:version'
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return text
    raw = text.encode()
    if len(raw) > AGREE_BYTES - 1:
        raise ValueError(f"{text!r} is longer than {AGREE_BYTES - 1} bytes")
    # NCCL moves only CUDA tensors; every other backend takes CPU ones.
    on_cuda = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    buf = torch.zeros(AGREE_BYTES, dtype=torch.uint8)
    buf[0] = len(raw)
    buf[1 : 1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    buf = buf.to(device)
    work = dist.broadcast(buf, src=0, async_op=True)
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as e:  # the backend's own timeout or a peer that left
        raise ShardserveError(
            f"rank {dist.get_rank()} waited {timeout:.0f} s for rank 0's shardserve job over "
            f"torch.distributed and got none ({e}); create the Loader on every rank, in the "
            "same order"
        ) from None
    if ok is False:
        raise ShardserveError(
            f"rank {dist.get_rank()} waited {timeout:.0f} s for rank 0's shardserve job over "
            "torch.distributed; create the Loader on every rank, in the same order"
        )
    got = buf.cpu()
    return bytes(got[1 : 1 + int(got[0])].tolist()).decode()
