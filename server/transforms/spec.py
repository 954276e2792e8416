"""A job's chain checked against the installed transforms and the dataset's fields.

:func:`compile_chain` turns ``[{"name", "params"}, ...]`` into :class:`Chain`: each step's
transform and validated parameters, and the fields after every step, so buffers and slots
are laid out before the first batch. Anything wrong is a ``BadRequest`` (HTTP 422) that
lists what exists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ValidationError

from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import TransformStep

from .fused import ORDER, fusable, unfused
from .registry import Transform, TransformRegistry
from .rng import CURRENT_SCHEME, LEGACY_SCHEME
from .schema import Field


@dataclass(frozen=True)
class Step:
    transform: Transform
    params: BaseModel
    #: Fields this step writes, as declared for these params and inputs.
    writes: dict[str, Field]
    #: Worst-case bytes per sample while it runs: the fixed fields it reads and writes and
    #: what it holds besides (its declared ``peak``).
    held: int = 0
    #: Positions in the job's chain of the steps this one runs (one; several when fused):
    #: each one's randomness comes from its own position, fused or not.
    origin: tuple[int, ...] = ()


@dataclass(frozen=True)
class Chain:
    steps: tuple[Step, ...]
    inputs: dict[str, Field]
    #: Every field after the last step (input fields not written pass through).
    outputs: dict[str, Field]
    #: The job's randomness scheme (see :mod:`.rng`).
    scheme: int = CURRENT_SCHEME

    @property
    def names(self) -> list[str]:
        return [s.transform.name for s in self.steps]

    @property
    def wants_process(self) -> bool:
        return any(s.transform.pool == "process" for s in self.steps)

    @property
    def batch_steps(self) -> bool:
        """Whether a step needs the whole batch: a batch step drawing from the batch's
        generator. A keyed one (``takes_keys``, scheme 2 on) draws per sample, so its batch
        can be cut into pieces like a sample step's."""
        return any(
            s.transform.shape == "batch"
            and (not s.transform.takes_keys or self.scheme == LEGACY_SCHEME)
            for s in self.steps
        )


def _problems(e: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, err['loc'])) or 'params'}: {err['msg']}" for err in e.errors()
    )


def compile_chain(
    steps: Sequence[TransformStep | Mapping[str, object]],
    registry: TransformRegistry,
    inputs: Mapping[str, Field],
    dataset: str,
    passed: Sequence[str] = (),
    scheme: int = CURRENT_SCHEME,
) -> Chain:
    """The checked chain, or ``BadRequest`` naming the step and what to change. ``passed``:
    fields of the dataset the chain never sees (missing in some samples), served as stored;
    ``scheme``: the job's randomness scheme."""
    fields = dict(inputs)
    aside = (
        f"; fields missing in some samples ({list(passed)}) are served as stored, never given "
        "to transforms"
        if passed
        else ""
    )
    out: list[Step] = []
    for i, step in enumerate(_unfused(steps)):
        t = registry.get(step.name)
        if t is None:
            raise BadRequest(
                f"transforms[{i}]: no transform named {step.name!r} on this server; installed: "
                f"{registry.names()} (GET /v1/transforms describes them)"
            )
        try:
            params = t.params.model_validate(step.params)
        except ValidationError as e:
            schema = t.params.model_json_schema().get("properties", {})
            raise BadRequest(
                f"transforms[{i}] {step.name!r}: bad params: {_problems(e)}; its params are "
                f"{ {k: v.get('type', v.get('anyOf', '?')) for k, v in schema.items()} }"
            ) from None
        try:
            writes = t.output_fields(params, fields)
            peak = t.peak(params, fields) if t.peak is not None else 0
        except Exception as e:  # a transform's own check (any exception) is the job's 422
            have = {n: f.describe() for n, f in fields.items()}
            # A KeyError's text is only the key's repr: say what it means.
            why = (
                f"it reads field {e.args[0]!r}, which is not there"
                if isinstance(e, KeyError) and e.args
                else e
            )
            raise BadRequest(
                f"transforms[{i}] {step.name!r} does not fit dataset {dataset!r}: {why}; the "
                f"fields at that step are {have}{aside}"
            ) from None
        if clash := sorted(set(writes) & set(passed)):
            raise BadRequest(
                f"transforms[{i}] {step.name!r} writes {clash}, a field missing in some samples "
                f"of dataset {dataset!r}; write another name"
            )
        if t.shape == "batch" and any(not f.fixed for f in writes.values()):
            raise BadRequest(
                f"transforms[{i}] {step.name!r}: a batch transform writes fixed shapes"
            )
        held = _fixed_bytes(fields) + _fixed_bytes(writes) + peak
        fields.update(writes)
        out.append(Step(t, params, writes, held, (i,)))
    return Chain(fuse(out), dict(inputs), fields, scheme)


def _unfused(steps: Sequence[TransformStep | Mapping[str, object]]) -> list[TransformStep]:
    """``steps`` checked, a fused step (as a compiled chain names it to worker processes)
    given as the steps it runs, in its place."""
    out: list[TransformStep] = []
    for raw in steps:
        step = raw if isinstance(raw, TransformStep) else TransformStep.model_validate(raw)
        parts = unfused(step.name, step.params)
        out.extend([TransformStep.model_validate(p) for p in parts] if parts else [step])
    return out


def fuse(steps: Sequence[Step]) -> tuple[Step, ...]:
    """``steps`` with each run of consecutive fusable built-ins (:mod:`.fused`) as one step:
    it writes what the run's last step writes and holds what its largest step holds."""
    out: list[Step] = []
    i = 0
    while i < len(steps):
        plan = fusable([(s.transform, s.params) for s in steps[i : i + len(ORDER)]])
        if plan is None:
            out.append(steps[i])
            i += 1
            continue
        run = steps[i : i + plan.length]
        origin = tuple(o for s in run for o in s.origin)
        held = max(s.held for s in run)
        out.append(Step(plan.transform, plan.params, run[-1].writes, held, origin))
        i += plan.length
    return tuple(out)


def _fixed_bytes(fields: Mapping[str, Field]) -> int:
    """Bytes per sample of the fixed-size ``fields`` (variable ones are bounded at run time)."""
    return sum(math.prod(f.shape) * np.dtype(f.dtype).itemsize for f in fields.values() if f.fixed)


def check_chain_bytes(chain: Chain, batch_size: int, max_batch_bytes: int) -> None:
    """``BadRequest`` naming the first step whose worst case per batch (the fields it reads
    and writes, and what it holds besides, times ``batch_size``) is over ``max_batch_bytes``.

    CIFAR (uint8 [3, 32, 32]) with ``random_crop`` padding 1024 holds a 2080 x 2080 padded
    copy, 12,979,200 bytes per sample: at batch_size 128 that is 1.66 GB, refused under the
    default 1 GiB.
    """
    for i, step in enumerate(chain.steps):
        need = step.held * batch_size
        if need > max_batch_bytes:
            raise BadRequest(
                f"transforms[{i}] {step.transform.name!r} holds up to {need} bytes for a batch "
                f"({step.held} bytes per sample x batch_size {batch_size}), more than "
                f"--max-batch-bytes {max_batch_bytes}: make its output (size, padding) or the "
                "batch smaller"
            )
