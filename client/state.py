"""Checking a ``Loader.state_dict()`` before resuming from it.

A state dict comes back from a checkpoint file that may be from another version, another job,
hand-edited or damaged. Every problem is one ``BadRequest`` that names the key, what it held
and what was expected, instead of a ``KeyError`` or a raw pydantic dump.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import JobSpec

KEYS = ("version", "spec", "epoch", "next_batch", "rank", "world_size")


@dataclass(frozen=True)
class ResumeState:
    """The checked contents of a state dict."""

    spec: JobSpec
    epoch: int
    next_batch: int
    rank: int
    world_size: int


def _int(state: Mapping[str, Any], key: str, low: int = 0) -> int:
    v = state[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise BadRequest(f"state dict key {key!r} is {v!r}; expected an integer >= {low}")
    return v


def parse_state(state: object, version: int) -> ResumeState:
    """The checked state, or ``BadRequest`` saying what is wrong with it."""
    if not isinstance(state, Mapping):
        raise BadRequest(
            f"a state dict must be the dict Loader.state_dict() returned, got {type(state).__name__}"
        )
    missing = [k for k in KEYS if k not in state]
    if missing:
        raise BadRequest(
            f"state dict lacks key(s) {missing}; pass the dict Loader.state_dict() returned"
        )
    if state["version"] != version:
        raise BadRequest(f"state version {state['version']!r}; this client reads {version}")
    if not isinstance(state["spec"], Mapping):
        raise BadRequest(f"state dict key 'spec' is {state['spec']!r}; expected the job spec dict")
    try:
        spec = JobSpec.model_validate(dict(state["spec"]))
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'spec'}: {err['msg']}" for err in e.errors()
        )
        raise BadRequest(f"state dict key 'spec' is not a valid job spec: {problems}") from None
    world_size = _int(state, "world_size", 1)
    rank = _int(state, "rank")
    if rank >= world_size:
        raise BadRequest(f"state dict rank {rank} out of range 0 <= rank < {world_size}")
    return ResumeState(spec, _int(state, "epoch"), _int(state, "next_batch"), rank, world_size)
