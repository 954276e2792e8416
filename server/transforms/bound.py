"""A stream's dataset with its job's transform chain applied: what the streamer takes from.

:class:`Transforms` is the server's one runtime (registry, pool, metrics), made by the
service from settings. :meth:`Transforms.bind` wraps a dataset for one stream (seed, epoch,
rank); the wrapper's ``part_shapes`` and ``manifest.fields`` are the chain's declared outputs,
so buffers and slots are laid out before the first batch, and its ``take`` reads the stored
fields, runs the chain on the pool and writes the results into the stream's buffers.

With ``on_error="replace"`` a sample whose transform raises is swapped for a deterministic
other one (:func:`~.rng.replacement`; every failing sample of the step at once) and the
batch is run again; a place that fails ``MAX_REPLACEMENTS`` times in a row fails the job.
Batch sizes stay equal across ranks. ``on_error="quarantine"`` (a mixture) replaces the same
way and hands the failing samples to the stream's ``quarantine`` (see
:meth:`~..mixture_admin.MixtureAdmin.quarantine_failed`), so later epochs skip them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from shardserve.proto.errors import BadRequest, DataError, TransformError
from shardserve.proto.jobs import JobSpec, job_id
from shardserve.proto.manifest import Manifest
from shardserve.proto.parts import parts_of

from ..runtime.assembly_lanes import ASSEMBLY_PER_JOB
from ..source import FRESH, BatchParts, BatchSource, PartShapes, RowPick, Tail, Wrapped
from .chunks import concat_parts
from .device_plan import device_manifest
from .errors import StepFailed, pool_error, transform_error
from .fused import passes_only
from .metrics import CHAIN_FAILED, TransformMetrics
from .pool import PoolSetting, TransformPool
from .pushdown import pushdown_of
from .registry import TransformRegistry
from .rng import job_scheme, replacement
from .runner import Limits, Where, run_chain
from .schema import from_field_spec, to_field_spec
from .spec import Chain, check_chain_bytes, compile_chain

MAX_REPLACEMENTS = 8
#: ``quarantine(job id, sample ids, reason)``: samples whose transform failed, skipped by
#: the job's later plans; ``BadRequest`` when they cannot be (the job then fails).
Quarantine = Callable[[str, Sequence[int], str], None]
#: A chain of built-in passes runs on the thread assembling its batch (the streamer's too)
#: only if a step of it holds at most this many bytes for a batch (its fields and a padded
#: copy: CIFAR's normalize at batch 256, 3.9 MB): a few milliseconds of work at most.
INLINE_HELD_BYTES = 16 << 20


class Transforms:
    """The server's transforms: what is installed, where chains run, what they cost."""

    def __init__(
        self,
        modules: Sequence[str],
        workers: int,
        pool: PoolSetting,
        timeout_s: float,
        registry: CollectorRegistry | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.registry = TransformRegistry.load(modules)
        self.metrics = TransformMetrics(registry)
        self.limits = limits or Limits()
        self.pool = TransformPool(
            workers, pool, modules, timeout_s, self.metrics, self.limits, ASSEMBLY_PER_JOB
        )

    def served(self, spec: JobSpec, manifest: Manifest) -> Manifest:
        """What job ``spec`` serves of the stored dataset ``manifest``: the chain's outputs
        when it has transforms (``BadRequest`` when the chain does not fit), else itself."""
        chained = (
            chain_manifest(self.compile(spec, manifest), manifest) if spec.transforms else manifest
        )
        return device_manifest(spec, chained)  # and the device steps' drawn parameters

    def sample_bytes(self, spec: JobSpec, manifest: Manifest) -> float:
        """Bytes of one sample as job ``spec`` serves the stored dataset ``manifest``."""
        stored = manifest.total_bytes / max(manifest.num_samples, 1)
        if not spec.transforms:
            return stored
        return chain_sample_bytes(self.compile(spec, manifest), stored)

    def compile(self, spec: JobSpec, manifest: Manifest) -> Chain:
        """The job's checked chain (``BadRequest`` when it does not fit). Fields missing in
        some samples are not its inputs: they pass by it, masks and all."""
        inputs = {f.name: from_field_spec(f) for f in manifest.fields if not f.nullable}
        passed = [f.name for f in manifest.fields if f.nullable]
        chain = compile_chain(
            spec.transforms or (), self.registry, inputs, manifest.name, passed, job_scheme(spec)
        )
        check_chain_bytes(chain, spec.batch_size, self.limits.max_batch_bytes)
        return chain

    def bind(
        self,
        source: BatchSource,
        spec: JobSpec,
        epoch: int,
        seed: int,
        rank: int,
        quarantine: Quarantine | None = None,
    ) -> BatchSource:
        """``source`` as the stream of (``seed``, ``epoch``, ``rank``) sees it; ``source``
        itself when the job has no transforms. ``quarantine``: where failing samples go
        with ``on_error="quarantine"``."""
        if not spec.transforms:
            return source
        return TransformedDataset(
            source,
            self.compile(spec, source.manifest),
            self,
            spec,
            epoch,
            seed,
            rank,
            quarantine,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "transforms": self.registry.describe(),
            "pool": self.pool.status(),
            "counts": self.metrics.snapshot(),
        }

    def close(self) -> None:
        self.pool.close()


def chain_manifest(chain: Chain, stored: Manifest) -> Manifest:
    """The ``stored`` dataset as a job with ``chain`` serves it: the chain's outputs, then the
    fields missing in some samples (as stored), as its fields (its bytes are the stored
    shards'; a served sample's are :func:`chain_sample_bytes`)."""
    fields = (
        *(to_field_spec(n, f) for n, f in chain.outputs.items()),
        *(f for f in stored.fields if f.nullable),
    )
    return stored.model_copy(update={"fields": fields})


def chain_sample_bytes(chain: Chain, stored_sample_bytes: float) -> float:
    """Bytes of a sample as ``chain`` serves it: its fixed-size outputs' bytes, or the stored
    average when that is more (variable-size outputs are counted at the stored size)."""
    fixed = sum(
        math.prod(f.shape) * np.dtype(f.dtype).itemsize for f in chain.outputs.values() if f.fixed
    )
    return max(stored_sample_bytes, float(fixed))


#: Samples read to size the fields a chain passes by: the first ones, so one block of the
#: store is read (and verified) and nothing is fetched from anywhere; never more than a
#: batch, whose memory the job's admission bounded.
SIZING_ROWS = 64


def served_sample_bytes(
    chain: Chain, inner: BatchSource, passed: Sequence[str], batch_size: int
) -> float:
    """A stream's estimate of a sample's bytes after ``chain``: its fixed-size outputs plus the
    average of the ``passed`` fields over the first :data:`SIZING_ROWS` samples (at most
    ``batch_size``), when every output is fixed and ``inner`` reads without waiting; else
    :func:`chain_sample_bytes`.

    A chain that cuts a big variable field to a fixed size (``random_subset`` of a point
    cloud) serves a fraction of the stored average, and batches go several to a message by
    this figure. A batch bigger than it still goes, over the socket (see ``..streaming.shm``).
    """
    outputs = chain.outputs.values()
    rows = min(SIZING_ROWS, batch_size, inner.manifest.num_samples)
    if not inner.inline_ok or not rows or not all(f.fixed for f in outputs):
        return chain_sample_bytes(chain, inner.sample_bytes)
    fixed = sum(math.prod(f.shape) * np.dtype(f.dtype).itemsize for f in outputs)
    if not passed:
        return float(fixed)
    try:
        parts = inner.take(np.arange(rows), passed)
    except DataError:  # rows this stream may never read: its own reads say what is wrong
        return chain_sample_bytes(chain, inner.sample_bytes)
    return fixed + sum(a.nbytes for a in parts.values()) / rows


class TransformedDataset(Wrapped):
    """A source whose ``take`` runs a chain and whose fields are the chain's outputs; it
    never runs inline, and each batch is assembled on its job's own lane."""

    def __init__(
        self,
        inner: BatchSource,
        chain: Chain,
        runtime: Transforms,
        spec: JobSpec,
        epoch: int,
        seed: int,
        rank: int,
        quarantine: Quarantine | None = None,
    ) -> None:
        super().__init__(inner)
        self.chain = chain
        self._rt = runtime
        self._spec = spec
        self._quarantine = quarantine if spec.on_error == "quarantine" else None
        #: The job's own transform lane: a transform of this job that hangs keeps only it.
        self._lane = job_id(spec)
        #: A chain of built-in image passes only (see :func:`~.fused.passes_only`) runs on the
        #: thread assembling its batch, the streamer's own included: no hand-off to a lane.
        self._passes = (
            passes_only([s.transform for s in chain.steps])
            and not runtime.pool.uses_processes(chain)
            and max(s.held for s in chain.steps) * spec.batch_size <= INLINE_HELD_BYTES
        )
        self._epoch, self._seed, self._rank = epoch, seed, rank
        self._manifest = chain_manifest(chain, inner.manifest)
        self.fields = self._manifest.fields
        #: Fields missing in some samples: read after the chain, for the samples it kept.
        self._passed = {f.name for f in self.fields if f.nullable}
        self._sample_bytes = served_sample_bytes(
            chain, inner, sorted(self._passed), spec.batch_size
        )
        written = {k for step in chain.steps for k in step.writes}
        #: Inputs no step writes, served as stored: gathered straight into the stream's slot
        #: (a copy there after the chain, 8% of a CIFAR batch's server CPU, is then none).
        self._through = [
            n for n, f in chain.inputs.items() if n not in written and chain.outputs[n] == f
        ]
        #: A chain that only chooses rows of a variable field reads only those (.pushdown).
        self._pushdown = pushdown_of(chain)

    @property
    def manifest(self) -> Manifest:
        """The stored dataset's, with the chain's outputs (then the fields missing in some
        samples, which pass by it) as its fields."""
        return self._manifest

    @property
    def sample_bytes(self) -> float:
        """A sample's bytes after the chain (see :func:`chain_sample_bytes`)."""
        return self._sample_bytes

    @property
    def lane(self) -> str:
        """The job's lane: its batches and transform pieces run on threads of its own."""
        return self._lane

    @property
    def inline_ok(self) -> bool:
        """Only for a chain of built-in image passes (crop, flip, normalize: bounded work
        that cannot hang, see :func:`~.fused.passes_only`) over at most
        :data:`INLINE_HELD_BYTES` a batch; any other transform may take
        long, or hang until its deadline, and runs on its job's lane. The pipeline still
        sends a batch too big, or after one too slow, to the pool (CIFAR normalized to
        float32 at batch 256, 3 MiB, runs on the streamer: 1.4-1.6 ms of server CPU a
        batch with the compiled kernel, 199k samples a second on two cores; on its job's
        two lanes, though the kernel runs without the GIL, the hand-offs make it 2.1 ms
        and 146k a second. On numpy: 2.2-2.4 ms inline, 3.0 ms on the lanes)."""
        return self._passes

    @property
    def groupable(self) -> bool:
        """Not when a step sees whole batches (its numbers are drawn per batch): several
        batches in one message would change what it sees."""
        return not self.chain.batch_steps and self.inner.groupable

    def field_names(self, fields: Sequence[str] | None = None) -> list[str]:
        known = [f.name for f in self.fields]
        names = list(fields) if fields is not None else known
        unknown = [n for n in names if n not in known]
        if unknown:
            raise BadRequest(f"no field(s) {unknown} after the transforms; fields are {known}")
        return names

    def part_shapes(self, fields: Sequence[str] | None = None) -> PartShapes:
        specs = {f.name: f for f in self.fields}
        return {p: shape for n in self.field_names(fields) for p, shape in parts_of(specs[n])}

    def take(
        self,
        indices: np.ndarray | Sequence[int],
        fields: Sequence[str] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        batch: int = -1,
        tail: Tail = FRESH,
    ) -> BatchParts:
        """Batch ``batch`` of this stream: stored fields of ``indices`` through the chain, and
        the fields missing in some samples as stored, for the samples the chain kept."""
        names = self.field_names(fields)
        passed = [n for n in names if n in self._passed]
        if passed:
            ran = self._run([n for n in names if n not in self._passed], indices, out, batch, tail)
            kept, parts = ran
            parts.update(self.inner.take(kept, passed, out=out, batch=batch, tail=tail))
            return {p: parts[p] for p in self.part_shapes(names)}  # in the layout's order
        return self._run(names, indices, out, batch, tail)[1]

    def take_rows(
        self, indices: np.ndarray, field: str, pick: RowPick, out: np.ndarray
    ) -> np.ndarray:
        """Refused: this source serves the chain's outputs, whose rows are not stored."""
        raise ValueError(
            f"rows of field {field!r} are read from a stored dataset; dataset "
            f"{self.manifest.name!r} is served through transforms {self.chain.names}"
        )

    def _into(self, out: Mapping[str, np.ndarray] | None, b: int) -> dict[str, np.ndarray]:
        """The arrays of ``out`` that inputs served as stored are gathered into: those with
        exactly the field's ``[b, *shape]``, dtype and a contiguous layout."""
        into = {}
        for n in self._through:
            a = out.get(n) if out is not None else None
            f = self.chain.inputs[n]
            fits = a is not None and a.shape == (b, *f.shape) and a.dtype == np.dtype(f.dtype)
            if a is not None and fits and a.flags.c_contiguous:
                into[n] = a
        return into

    def _run(
        self,
        names: list[str],
        indices: np.ndarray | Sequence[int],
        out: Mapping[str, np.ndarray] | None,
        batch: int,
        tail: Tail,
    ) -> tuple[np.ndarray, BatchParts]:
        """The chain's outputs ``names`` of ``indices``, and the samples they are of (failing
        ones replaced with ``on_error="replace"``)."""
        idx = np.array(indices, dtype=np.int64).reshape(-1)
        where = Where(self._seed, self._epoch, self._rank, batch, self.chain.scheme)
        name = self.manifest.name
        attempts: dict[int, int] = {}
        while True:
            try:
                return idx, self._chained(idx, where, names, out, tail)
            except StepFailed as e:
                self._rt.metrics.errors.labels(e.transform).inc()
                self._rt.metrics.count("errors")
                replace = self._spec.on_error in ("replace", "quarantine") and e.replaceable
                if (
                    not replace
                    or not e.all
                    or any(attempts.get(p, 0) >= MAX_REPLACEMENTS for p, _ in e.all)
                ):
                    raise transform_error(name, self._epoch, e) from None
                if self._quarantine is not None:
                    reason = f"transform {e.transform!r} failed in job {self._lane}: {e.text}"
                    try:
                        self._quarantine(self._lane, [f for _, f in e.all], reason[:512])
                    except BadRequest as q:
                        raise TransformError(
                            f"{transform_error(name, self._epoch, e)}; and it cannot be "
                            f"quarantined: {q}"
                        ) from None
                idx = idx.copy()
                for pos, failed in e.all:
                    attempt = attempts[pos] = attempts.get(pos, 0) + 1
                    lo, hi = self.inner.replaceable_by(failed)
                    idx[pos] = lo + replacement(
                        self._seed, self._epoch, failed - lo, attempt, hi - lo
                    )
                self._rt.metrics.replaced.inc(len(e.all))
                self._rt.metrics.count("replaced", len(e.all))
            except TransformError:
                # Not the chain's names: chains are the client's to choose, labels must stay few.
                self._rt.metrics.errors.labels(CHAIN_FAILED).inc()
                self._rt.metrics.count("errors")
                raise

    def _chained(
        self,
        idx: np.ndarray,
        where: Where,
        names: list[str],
        out: Mapping[str, np.ndarray] | None,
        tail: Tail,
    ) -> BatchParts:
        """The chain's outputs ``names`` of samples ``idx``: read, then run on the pool (or,
        pushed down, read as the chain chooses; built-in passes on this thread)."""
        into = self._into(out, idx.size)
        if self._pushdown is not None:
            return self._pushdown.run(
                self.inner, idx, where, names, out, into, tail, self._rt.metrics
            )
        stored = self.inner.take(idx, list(self.chain.inputs), out=into, batch=where.batch)
        describe = partial(pool_error, self.manifest.name, self._epoch, self.chain.names, idx)
        if self._passes:
            return self._run_here(stored, idx, where, names, describe, out)
        return self._rt.pool.run(
            self.chain, stored, idx, where, names, describe, out, tail, lane=self._lane
        )

    def _run_here(
        self,
        stored: Mapping[str, np.ndarray],
        idx: np.ndarray,
        where: Where,
        names: list[str],
        describe: Callable[[str], TransformError],
        out: Mapping[str, np.ndarray] | None,
    ) -> BatchParts:
        """The chain of built-in passes on this thread (the streamer's, or the job lane's
        that assembles the batch), with no hand-off. Its deadline holds without a watcher:
        its steps run numpy over the batch's fixed-size bytes (capped by
        ``--max-batch-bytes`` at job creation), with nothing that waits, so it ends within
        the time of a few passes over memory; one that still ends past the deadline (a
        starved machine) fails its batch, as a run on another thread does."""
        timeout_s = self._rt.pool.timeout_s
        t0 = time.monotonic()
        result, spent = run_chain(self.chain, stored, idx, where, names, out, self._rt.limits)
        if time.monotonic() - t0 > timeout_s:
            raise describe(f"finished after its deadline of {timeout_s} s")
        self._rt.metrics.ran(spent, len(idx))
        return concat_parts([result], self.chain.outputs, names, out)
