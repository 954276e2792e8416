"""A job on one server as a Loader (or ``plan``) makes it: the ``JobSpec`` its arguments make
(:class:`JobArgs`) and the :class:`JobHandle` that posts it and keeps what the server pinned. The HTTP calls themselves are :class:`~.control.ControlClient`'s.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from shardserve.proto.api import CreatedJob, DatasetInfo
from shardserve.proto.errors import BadRequest, DatasetChanged, ShardserveError
from shardserve.proto.jobs import (
    MAX_ENVS,
    CollateArg,
    EnvShuffle,
    JobSpec,
    OnError,
    ShuffleMode,
)

from ._offthread import within
from .control import ControlClient, server_token, server_url
from .distributed import World, agree_with_rank0
from .mixture import Mixture, mixture_sources

#: Per-operation timeout of re-posting a job while a stream recovers (off the stream's thread).
RECREATE_TIMEOUT_S = 5.0
#: Wall-clock bound on what a stall error reports about the server (a name lookup has no
#: timeout of its own; see ``_offthread``).
DESCRIBE_WITHIN_S = 2.0
#: What ``shuffle=`` accepts: True/False or a mode by name.
Shuffle: TypeAlias = bool | ShuffleMode
#: The job's shuffle mode for each value of ``shuffle=``.
SHUFFLE: dict[object, ShuffleMode] = {
    True: "global",
    False: "none",
    "global": "global",
    "block": "block",
    "none": "none",
}


def _positive_int(batch_size: object) -> int:
    """``batch_size`` as an ``int``: any integer type (numpy's too, as ``range`` takes them),
    never a bool, a float or a string; ``BadRequest`` naming it otherwise."""
    try:
        value = operator.index(batch_size)  # type: ignore[arg-type]
    except TypeError:
        value = 0
    if isinstance(batch_size, (bool, np.bool_)) or value < 1:
        raise BadRequest(f"batch_size={batch_size!r} must be a positive integer")
    return value


@dataclass(frozen=True, kw_only=True)
class JobArgs:
    """The arguments of a ``Loader`` (or ``plan``) that say which batches its job holds, as
    given; :meth:`spec` checks them and makes the job. With ``envs > 1`` each batch of the
    job is one step of ``envs`` batches of ``batch_size``, drawn as ``env_shuffle`` says.
    ``dataset`` as ``{name: weight}`` (or a list of sources): a mixture (see :mod:`.mixture`),
    ``epoch_samples`` long (``None``: the datasets' sizes summed).

    >>> JobArgs(dataset="cifar", batch_size=64, seed=0, shuffle=False, drop_last=False,
    ...         fields=None, collate=None, transforms=None, on_error=None).spec(2).shuffle
    'none'
    """

    dataset: str | Mixture
    batch_size: int
    seed: int
    shuffle: Shuffle
    drop_last: bool
    fields: Sequence[str] | None
    collate: CollateArg | None
    #: Transforms installed on the server, named with JSON params (never code).
    transforms: Sequence[Mapping[str, Any]] | None
    on_error: OnError | None
    envs: int = 1
    env_shuffle: EnvShuffle = "independent"
    epoch_samples: int | None = None
    share: str | None = None

    def spec(self, world_size: int) -> JobSpec:
        """The job for ``world_size`` ranks; ``BadRequest`` naming the argument when one
        cannot be served."""
        if self.shuffle not in SHUFFLE:
            raise BadRequest(
                f"shuffle={self.shuffle!r}: use True, False, 'global', 'block' or 'none'"
            )
        if not 1 <= self.envs <= MAX_ENVS:
            raise BadRequest(f"envs={self.envs} is out of range 1 <= envs <= {MAX_ENVS}")
        batch_size = _positive_int(self.batch_size)
        mix = _mixture_of(self.dataset, self.epoch_samples)
        _check_lists(self.fields, self.transforms)
        try:
            return JobSpec.model_validate(
                {
                    "dataset": None if mix is not None else self.dataset,
                    "mixture": mix,
                    "epoch_samples": self.epoch_samples,
                    "batch_size": batch_size * self.envs,
                    "seed": self.seed,
                    "shuffle": SHUFFLE[self.shuffle],
                    "drop_last": self.drop_last,
                    "world_size": world_size,
                    "fields": tuple(self.fields) if self.fields is not None else None,
                    "collate": self.collate,
                    "envs": self.envs,
                    "env_shuffle": self.env_shuffle,
                    "transforms": tuple(self.transforms) if self.transforms is not None else None,
                    "on_error": self.on_error,
                    "share": self.share,
                }
            )
        except ValueError as e:  # pydantic's ValidationError: name the argument, not the model
            raise BadRequest(f"these Loader arguments make no job: {e}") from None


def _mixture_of(dataset: str | Mixture, epoch_samples: int | None) -> list[dict] | None:
    """A mixture's sources as the spec takes them; ``None`` for one dataset by name."""
    if isinstance(dataset, str):
        if epoch_samples is not None:
            raise BadRequest(
                "epoch_samples sets a mixture's epoch: give dataset={name: weight, ...}"
            )
        return None
    return [s.model_dump(mode="json") for s in mixture_sources(dataset)]


def _check_lists(
    fields: Sequence[str] | None, transforms: Sequence[Mapping[str, Any]] | None
) -> None:
    """Refuse a string for ``fields`` and a mapping for ``transforms``: both are sequences, of
    characters and of keys, which would make a job of something else."""
    if isinstance(fields, (str, bytes)):
        raise BadRequest(f"fields={fields!r} must be a list of field names: fields=[{fields!r}]")
    if isinstance(transforms, Mapping):
        raise BadRequest(f"transforms must be a list of steps: transforms=[{dict(transforms)!r}]")


class JobHandle:
    """One job on one server, created from a Loader's (or ``plan``'s) arguments: the one
    place that reads the URL and token fallbacks, posts the spec and keeps what the server
    pinned; then what the data-plane stream needs of it (re-create it, describe it).

    >>> spec = JobArgs(dataset="cifar", batch_size=64, seed=0, shuffle=True, drop_last=False,
    ...                fields=None, collate=None, transforms=None, on_error=None).spec(1)
    >>> with JobHandle.create(None, None, spec, timeout=10.0) as job:  # doctest: +SKIP
    ...     job.id, job.version, job.batches_per_epoch
    ('0f3c...', '5e2d...', 782)
    """

    def __init__(
        self, api: ControlClient, spec: JobSpec, created: CreatedJob, token: str | None
    ) -> None:
        self.api, self.spec, self.token = api, spec, token
        self._adopt(created)
        self._info: DatasetInfo | None = None

    def _adopt(self, created: CreatedJob) -> None:
        # The server's id: it covers the dataset version the job pinned.
        self.id = created.id
        #: The spec as the server made the job: dataset version(s) pinned, as its id covers.
        self.pinned = created.status.spec
        self.version = created.status.spec.version
        #: Every dataset version the job reads (a mixture's sources each), as states record it.
        self.versions = created.status.spec.versions
        self.epoch = created.status.epoch
        self.num_samples = created.status.num_samples
        self.batches_per_epoch = created.status.batches_per_epoch
        #: A sample as the job serves it, in bytes (after transforms); ``None``: unknown.
        self.sample_bytes = created.sample_bytes

    @classmethod
    def create(
        cls,
        url: str | None,
        token: str | None,
        spec: JobSpec,
        *,
        timeout: float,
        world: World | None = None,
        check: Callable[[DatasetInfo], None] | None = None,
    ) -> JobHandle:
        """Post ``spec`` to the server at ``url`` (see :func:`server_url`) and keep the job.

        A server that is restarting refuses connections for a moment: that is retried within
        ``timeout``. ``check`` sees the dataset's description before the job is posted (a
        refusal then beats a failure at stream time). With ``world`` from an initialised
        ``torch.distributed``, the ranks agree on rank 0's job (and so its pinned dataset
        version) before any of them streams: see :meth:`agree`.
        """
        if isinstance(timeout, bool) or not timeout > 0:
            raise BadRequest(f"timeout={timeout} must be a positive number of seconds")
        token = server_token(token)
        api = ControlClient(
            server_url(url), token, timeout=min(timeout, 10.0), connect_retry_s=timeout
        )
        try:
            info = None
            if check is not None:
                info = api.dataset(spec.described_by)
                check(info)
            if world is not None and world.source == "torch.distributed" and world.world_size > 1:
                job = cls._create_agreed(api, spec, token, world, timeout)
            else:
                job = cls(api, spec, api.create_job(spec), token)
            job._info = info
            # The server is up; later calls run inside a stream's own deadline: no retries.
            api.connect_retry_s = 0.0
        except BaseException:
            api.close()
            raise
        return job

    @classmethod
    def _create_agreed(
        cls, api: ControlClient, spec: JobSpec, token: str | None, world: World, timeout: float
    ) -> JobHandle:
        """Rank 0 posts ``spec``; every other rank posts it pinned to rank 0's dataset version
        (every rank of the process group calls this, in the same order). A pinned spec is
        the same job, so ranks whose Loaders were made on either side of an ``ingest
        --overwrite`` still stream one version (two sample counts would desynchronise DDP),
        and the server never sees a second version of one run. A server that does not hold
        rank 0's version (another node's sidecar with other data) refuses, and the rank
        raises ``DatasetChanged`` naming both jobs."""
        mine = api.create_job(spec) if world.rank == 0 else None
        # Only rank 0's text is sent; the others' is a placeholder the broadcast overwrites.
        said = f"{mine.id}:{mine.status.spec.version or ''}" if mine is not None else "-"
        jid, _, version = agree_with_rank0(said, timeout=timeout).partition(":")
        if mine is None:
            mine = api.create_job(spec.model_copy(update={"version": version or None}))
        job = cls(api, spec, mine, token)
        if job.id != jid:  # the caller closes api
            raise DatasetChanged(
                f"rank 0 streams job {jid} of dataset {spec.dataset!r} version {version}, "
                f"this rank's server made job {job.id} (version {job.version}): the ranks of "
                "one run must train on one version"
            )
        return job

    def info(self) -> DatasetInfo:
        """The dataset's description (``GET /v1/datasets/{name}``), fetched once."""
        if self._info is None:
            self._info = self.api.dataset(self.spec.described_by)
        return self._info

    def recreate(self, timeout: float = RECREATE_TIMEOUT_S) -> None:
        """Re-POST the spec (after a server restart the job is unknown until then).

        The server pins the dataset's current version; another id than ours means the
        version this job streamed was replaced, and resuming would mix two versions.
        """
        created = self.api.create_job(self.spec, timeout=timeout)
        if created.id != self.id:
            raise DatasetChanged(
                f"dataset {self.spec.dataset!r} changed while the server was away: job "
                f"{self.id} streams version {self.version}, the store now holds version "
                f"{created.status.spec.version}; create a new Loader (job {created.id}) to "
                "train on it"
            )

    def describe(self) -> str:
        """Facts for a DataStallError, fetched within ``DESCRIBE_WITHIN_S``; never raises."""
        return within(
            self._describe,
            DESCRIBE_WITHIN_S,
            f"server {self.api.url} did not answer within {DESCRIBE_WITHIN_S:.0f} s (its name "
            f"{self.api.host!r} may not resolve, or the host not answer)",
        )

    def _describe(self) -> str:
        if not self.api.healthy(timeout=0.5):
            return f"server {self.api.url} does not answer GET /healthz"
        try:
            st = self.api.job(self.id, timeout=0.5)
        except ShardserveError as e:
            return f"server {self.api.url} is up; job status unavailable: {e}"
        err = f", error: {st.error}" if st.error else ""
        return f"server {self.api.url} is up; job {self.id} state: {st.state}{err}"

    def close(self) -> None:
        """Close the HTTP client; idempotent."""
        self.api.close()

    def __enter__(self) -> JobHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
