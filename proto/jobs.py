"""The job spec: what a job serves, and the id that names it.

A job is a pure function of its spec: the same spec always has the same id
(:func:`job_id`), on any server, before and after a restart. That is what lets every DDP
rank post the same spec and get the same job, and a restarted server pick up where the old
one stopped without a coordinator.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .manifest import validate_dataset_name

# Re-exported: callers import the mixture spec models from here, beside JobSpec.
from .mixtures import (  # noqa: F401
    MAX_MIXTURE_SOURCES,
    MAX_SCHEDULE,
    MIXTURE_PREFIX,
    Exhaustion,
    MixtureSource,
    WeightChange,
    check_weights,
    mixture_label,
)

#: An epoch's sample order: a full permutation, shards then samples within a window of
#: shards (locality), or the stored order.
ShuffleMode = Literal["global", "block", "none"]
#: How a batch's samples are put together: ``None`` stacks each field (the default);
#: ``"graph"`` collates graphs for message passing (node fields concatenated, ``edge_index``
#: offset, a ``batch`` vector), as ``torch_geometric`` does; ``{"graph": {...}}`` says how
#: (:class:`GraphCollate`).
Collate = Literal["graph"]

#: How the environments of a step draw their samples (``JobSpec.env_shuffle``): each from a
#: shuffle of its own, or all from one shuffle dealt across them (disjoint within a step and
#: an epoch, an epoch as long as one batch of ``envs * batch_size``).
EnvShuffle = Literal["independent", "split"]

#: What a failing sample transform does: fail the job, serve a deterministic other sample,
#: or (a mixture) serve another and quarantine the failing one in its dataset.
OnError = Literal["fail", "replace", "quarantine"]

#: Which kind of job a spec asks for (``JobSpec.kind``): one dataset, or a weighted mixture
#: of several. The server keeps one object per kind in a table keyed by this name
#: (``shardserve.server.jobs.kinds``), so the question is answered here and nowhere else.
JobKindName = Literal["dataset", "mixture"]

MAX_BATCH_SIZE = 1 << 20
MAX_WORLD_SIZE = 1 << 16
#: Most environments one step of a job may carry (``JobSpec.envs``).
MAX_ENVS = 1024
#: A share group's name: a letter or digit, then up to 63 letters, digits, ``.``, ``_``, ``-``.
SHARE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class GraphOptions(BaseModel):
    """How ``collate="graph"`` reads a dataset's graphs.

    >>> GraphOptions(node_field="atom_fea").node_field
    'atom_fea'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The field whose first dimension is each graph's node count (``atom_fea [n, F]``);
    #: ``None``: ``num_nodes``, else ``x``, else ``pos``, else the one field that can be.
    node_field: str | None = Field(default=None, min_length=1, max_length=128)


class GraphCollate(BaseModel):
    """``collate={"graph": {"node_field": "atom_fea"}}``: graph collation with options.

    >>> GraphCollate.model_validate({"graph": {"node_field": "atom_fea"}}).graph.node_field
    'atom_fea'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Required: ``collate={}`` (an empty config default) must not turn graphs on.
    graph: GraphOptions


#: What ``Loader(collate=...)`` takes: ``"graph"``, or ``{"graph": {"node_field": NAME}}``.
CollateArg = Collate | GraphCollate | Mapping[str, Mapping[str, str]]


class TransformStep(BaseModel):
    """One step of a job's transform chain: a transform installed on the server, by name,
    with JSON parameters (checked by the server against the transform's own schema)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("params")
    @classmethod
    def _canonical(cls, v: dict[str, Any]) -> dict[str, Any]:
        # Key order must not change the job id: {"a":1,"b":2} and {"b":2,"a":1} are one chain.
        out: dict[str, Any] = json.loads(json.dumps(v, sort_keys=True))
        return out

    def __hash__(self) -> int:  # params is a dict; the JSON form is the identity
        return hash(self.model_dump_json())


class JobSpec(BaseModel):
    """What to serve: which dataset, in which order, cut how. Everything that decides the
    batches is here and nothing else is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The dataset served; for a mixture job, :func:`mixture_label` of its sources (filled in
    #: when left out).
    dataset: str = Field(min_length=1, max_length=128)
    batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE)
    seed: int = Field(default=0, ge=0, lt=1 << 63)
    shuffle: ShuffleMode = "global"
    drop_last: bool = False
    world_size: int = Field(default=1, ge=1, le=MAX_WORLD_SIZE)
    #: Fields to serve, in this order; ``None`` serves every field of the dataset.
    fields: tuple[str, ...] | None = None
    #: For ``shuffle="block"``: how many shards are mixed together at a time.
    block_window: int = Field(default=4, ge=1, le=1 << 16)
    #: See :data:`Collate`; left out of the job id when ``None``, so ids of specs without it
    #: stay what they were.
    collate: Collate | GraphCollate | None = None
    #: The dataset version (content id, see ``server/store/versions.py``) the job serves.
    #: Clients leave it out; the server pins the version current at creation, so the job id
    #: covers it and a Loader created after ``ingest --overwrite`` gets a job of its own.
    #: Left out of the job id when ``None`` (ids of journals from before it stay the same).
    version: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")
    #: Server-side transforms applied to every batch, in order; like ``collate``,
    #: left out of the job id when ``None``.
    transforms: tuple[TransformStep, ...] | None = Field(default=None, max_length=64)
    #: Steps the trainer's device runs after the chain, on parameters the server draws.
    device_transforms: tuple[TransformStep, ...] | None = Field(default=None, max_length=64)
    #: ``"replace"``: a sample whose transform raises is replaced by a deterministic other one;
    #: ``"quarantine"`` (a mixture): replaced too, and quarantined in its dataset (skipped
    #: from the job's next epoch on, see the mixtures guide).
    on_error: OnError | None = None
    #: The randomness scheme of the built-in transforms' draws: 2, counter-based per sample
    #: (pinned by the server on a new job with transforms); ``None`` is scheme 1, the
    #: generators of jobs made before it (a journaled or saved job goes on with its own).
    #: Left out of the job id when ``None``.
    transform_rng: Literal[1, 2] | None = None

    #: Environments per step: each batch carries ``envs`` environment batches of
    #: ``batch_size // envs`` samples, environment ``e`` from the plan of
    #: ``SeedSequence([seed, epoch, e])`` (environment 0: the job's own plan); env ``e``'s rows
    #: are the ``e``-th of ``envs`` equal parts. Left out of the job id when 1.
    envs: int = Field(default=1, ge=1, le=MAX_ENVS)
    #: ``"split"``: one shuffle, the job's own, dealt across the environments: environment
    #: ``e`` of rank ``r`` takes the plan of rank ``r * envs + e`` of ``world_size * envs``
    #: (:func:`env_deal`), so a step's environments never share a sample and an epoch has
    #: ``len / (world_size * batch_size)`` steps. Needs ``envs > 1``; left out of the job id
    #: when ``"independent"``.
    env_shuffle: EnvShuffle = "independent"

    #: Several datasets with weights: each batch position draws its source with
    #: probability ``weight / sum(weights)``; see ``docs`` "Mixtures and curriculum". Left out
    #: of the job id when ``None``, like ``schedule`` and ``epoch_samples``.
    mixture: tuple[MixtureSource, ...] | None = Field(
        default=None, min_length=1, max_length=MAX_MIXTURE_SOURCES
    )
    #: Positions in a mixture epoch (all ranks together); ``None``: the sources' sizes summed.
    epoch_samples: int | None = Field(default=None, ge=1, lt=1 << 40)
    #: Weight changes by global step, ascending; more can be added while training
    #: (``PUT /v1/jobs/{id}/mixture``).
    schedule: tuple[WeightChange, ...] | None = Field(default=None, max_length=MAX_SCHEDULE)
    #: A share group's name: Loaders of the same spec and ``share`` are subscribers of one pass
    #: per rank (each batch planned, gathered and transformed once for all of them, see the
    #: "Sweeps and notebooks" guide). It never changes the batches; it is in the job id so that
    #: an unshared duplicate of the spec still meets ``RankInUse``. Left out of the id when
    #: ``None``.
    share: str | None = Field(default=None, json_schema_extra={"pattern": SHARE_NAME})

    @model_validator(mode="before")
    @classmethod
    def _mixture_dataset(cls, data: Any) -> Any:
        # A mixture names itself: {"mixture": [...]} needs no made-up dataset name.
        if isinstance(data, dict) and data.get("mixture") and not data.get("dataset"):
            names = [
                s.get("name", "?") if isinstance(s, dict) else getattr(s, "name", "?")
                for s in data["mixture"]
            ]
            data = {**data, "dataset": mixture_label([str(n) for n in names])}
        return data

    @model_validator(mode="after")
    def _check_mixture(self) -> JobSpec:
        if self.mixture is None:
            if self.dataset.startswith(MIXTURE_PREFIX):
                raise ValueError(
                    f"dataset {self.dataset!r} names a mixture, but the spec has no mixture: "
                    "give mixture=[{name, weight}, ...]"
                )
            if self.schedule is not None or self.epoch_samples is not None:
                raise ValueError("schedule and epoch_samples need a mixture")
            if self.on_error == "quarantine":
                raise ValueError(
                    "on_error='quarantine' needs a mixture job (one dataset's plans do not skip "
                    "samples yet): use on_error='replace'"
                )
            return self
        names = [s.name for s in self.mixture]
        if len(set(names)) != len(names):
            raise ValueError(f"mixture lists a dataset twice: {names}")
        if self.dataset != mixture_label(names):
            raise ValueError(
                f"dataset of a mixture job must be {mixture_label(names)!r} or left out, "
                f"got {self.dataset!r}"
            )
        check_weights(tuple(s.weight for s in self.mixture), len(names), "mixture weights")
        if self.version is not None:
            raise ValueError(
                "a mixture job cannot set version: each source pins its own (mixture[k].version)"
            )
        if self.ends_early and self.envs > 1 and self.env_shuffle == "independent":
            raise ValueError(
                "a mixture with a source that stops (on_exhausted='stop') ends each independent "
                "environment's order at its own step: use env_shuffle='split' or 'wrap'"
            )
        last = -1
        for k, c in enumerate(self.schedule or ()):
            check_weights(c.weights, len(names), f"schedule[{k}].weights")
            if c.at_step <= last:
                raise ValueError(
                    f"schedule[{k}].at_step {c.at_step} must be after schedule[{k - 1}].at_step {last}"
                )
            last = c.at_step
        return self

    def unpinned(self) -> JobSpec:
        """The spec without the dataset versions the server pinned (its own, or each
        mixture source's): two ranks' jobs of one run differ at most in those."""
        mix = tuple(s.model_copy(update={"version": None}) for s in self.mixture or ()) or None
        return self.model_copy(update={"version": None, "mixture": mix})

    @property
    def kind(self) -> JobKindName:
        """Which kind of job this is, the key of the server's table of job kinds: its
        callers hold the kind's object and never ask the spec again.

        Examples:
            >>> JobSpec(dataset="d", batch_size=8).kind
            'dataset'
            >>> JobSpec(mixture=[{"name": "web", "weight": 1.0}], batch_size=8).kind
            'mixture'
        """
        return "dataset" if self.mixture is None else "mixture"

    @property
    def pins(self) -> tuple[tuple[str, str | None], ...]:
        """``(dataset, version)`` of every dataset the job reads: the versions a store must
        keep while the job is known, and those a restart checks are still current."""
        if self.mixture is not None:
            return tuple((s.name, s.version) for s in self.mixture)
        return ((self.dataset, self.version),)

    @property
    def versions(self) -> str:
        """The pinned version(s), for messages: the dataset's, or ``name@version`` of each
        mixture source."""
        if self.mixture:
            return ", ".join(f"{s.name}@{s.version}" for s in self.mixture)
        return str(self.version)

    @property
    def ends_early(self) -> bool:
        """Whether an epoch may end before its nominal length: a mixture with a source that
        ends it when it runs out (its length then depends on the weights and quarantines)."""
        return any(s.on_exhausted == "stop" for s in self.mixture or ())

    @property
    def described_by(self) -> str:
        """The dataset whose description (fields, structure) the job's batches follow: its
        own, or a mixture's first source (every source serves the same fields).

        Examples:
            >>> JobSpec(mixture=[{"name": "web", "weight": 1.0}], batch_size=8).described_by
            'web'
        """
        return self.mixture[0].name if self.mixture else self.dataset

    @field_validator("collate")
    @classmethod
    def _plain_graph(cls, v: Collate | GraphCollate | None) -> Collate | GraphCollate | None:
        # {"graph": {}} asks for what "graph" does: one spec, one job id.
        if isinstance(v, GraphCollate) and v.graph == GraphOptions():
            return "graph"
        return v

    @property
    def graph(self) -> GraphOptions | None:
        """The graph collation asked for, ``None`` when samples are stacked.

        Examples:
            >>> JobSpec(dataset="d", batch_size=2, collate="graph").graph
            GraphOptions(node_field=None)
        """
        if self.collate is None:
            return None
        return self.collate.graph if isinstance(self.collate, GraphCollate) else GraphOptions()

    @property
    def env_batch(self) -> int:
        """Samples of one environment's batch (the whole batch when ``envs`` is 1)."""
        return self.batch_size // self.envs

    @property
    def env_orders(self) -> int:
        """How many epoch orders the job follows: one per environment, or with ``"split"``
        environments the job's own only."""
        return 1 if self.env_shuffle == "split" else self.envs

    @property
    def deal_world(self) -> int:
        """Over how many plans the epoch order is dealt (``env_deal`` deals it)."""
        return deal_world(self.world_size, self.envs, self.env_shuffle)

    @model_validator(mode="after")
    def _check_envs(self) -> JobSpec:
        if self.env_shuffle == "split" and self.envs == 1:
            raise ValueError(
                "env_shuffle='split' deals one shuffle across a step's environments: "
                "it needs envs > 1 (or leave env_shuffle out)"
            )
        if self.envs > 1:
            if self.batch_size % self.envs:
                raise ValueError(
                    f"batch_size {self.batch_size} must be a multiple of envs {self.envs} "
                    "(a step holds envs batches of equal size)"
                )
            if self.collate is not None:
                raise ValueError(
                    f"collate={self.collate!r} needs envs=1: each env batch would be cut out of one collated batch"
                )
        return self

    @field_validator("dataset")
    @classmethod
    def _check_dataset(cls, v: str) -> str:
        if v.startswith(MIXTURE_PREFIX):  # checked against the mixture in _check_mixture
            return v
        try:
            return validate_dataset_name(v)
        except ValueError as e:
            raise ValueError(str(e)) from None

    @field_validator("share")
    @classmethod
    def _check_share(cls, v: str | None) -> str | None:
        # Checked here rather than with Field(pattern=...): the 422 then says what a name
        # may be, not the regular expression.
        if v is not None and not re.fullmatch(SHARE_NAME, v):
            raise ValueError(
                f"share {v!r} is not a share name: one is 1 to 64 characters, a letter "
                "or digit first, then letters, digits, '.', '_' or '-' (e.g. 'sweep-3')"
            )
        return v

    @field_validator("fields")
    @classmethod
    def _check_fields(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is not None:
            if len(v) == 0:
                raise ValueError("fields must name at least one field, or be left out for all")
            if len(set(v)) != len(v):
                raise ValueError(f"fields lists a name twice: {list(v)}")
        return v


def job_id(spec: JobSpec) -> str:
    """A stable id for a spec: 16 hex digits of SHA-256 over its canonical JSON.

    >>> job_id(JobSpec(dataset="d", batch_size=2)) == job_id(JobSpec(batch_size=2, dataset="d"))
    True
    """
    # Fields added later are left out at their defaults: ids of older specs stay what they were.
    exclude = {
        k
        for k, unset in (
            ("collate", spec.collate is None),
            ("version", spec.version is None),
            ("transforms", spec.transforms is None),
            ("device_transforms", spec.device_transforms is None),
            ("on_error", spec.on_error is None),
            ("transform_rng", spec.transform_rng is None),
            ("envs", spec.envs == 1),
            ("env_shuffle", spec.env_shuffle == "independent"),
            ("mixture", spec.mixture is None),
            ("epoch_samples", spec.epoch_samples is None),
            ("schedule", spec.schedule is None),
            ("share", spec.share is None),
        )
        if unset
    }
    canonical = spec.model_dump_json(exclude_none=False, exclude=exclude or None).encode()
    return hashlib.sha256(canonical).hexdigest()[:16]


def deal_world(world_size: int, envs: int, env_shuffle: str) -> int:
    """Over how many plans an epoch order is dealt: one per rank; with ``env_shuffle="split"``
    one per environment of every rank (:func:`env_deal`).

    >>> deal_world(2, 4, "independent"), deal_world(2, 4, "split")
    (2, 8)
    """
    return world_size * envs if env_shuffle == "split" else world_size


def env_deal(spec: JobSpec, rank: int, env: int) -> tuple[int, int, int]:
    """Environment ``env`` of ``rank``: which order it follows (the ``env`` of
    ``SeedSequence([seed, epoch, env])``), dealt over how many plans, and as which one.
    Independent environments follow orders of their own, dealt over the ranks; split ones
    share the job's order, each environment dealt as a rank of its own, so within a step
    (and an epoch) no two environments of any rank take the same position.

    >>> spec = JobSpec(dataset="d", batch_size=8, envs=4, world_size=2, env_shuffle="split")
    >>> env_deal(spec, rank=1, env=2)
    (0, 8, 6)
    >>> env_deal(spec.model_copy(update={"env_shuffle": "independent"}), rank=1, env=2)
    (2, 2, 1)
    """
    if spec.env_shuffle == "split":
        return 0, spec.world_size * spec.envs, rank * spec.envs + env
    return env, spec.world_size, rank


def rank_plan_size(
    num_samples: int, world_size: int, batch_size: int, drop_last: bool
) -> tuple[int, int]:
    """How many ids each rank plans per epoch, and in how many batches
    (``torch.utils.data.DistributedSampler`` then ``DataLoader``): without ``drop_last`` the
    order is padded to a multiple of ``world_size`` and the last batch may be short; with it
    the order is cut to a multiple of ``world_size`` and a short last batch is dropped.

    >>> rank_plan_size(1000, 3, 64, False), rank_plan_size(1000, 3, 64, True)
    ((334, 6), (320, 5))
    """
    if drop_last:
        batches = num_samples // world_size // batch_size
        return batches * batch_size, batches
    per_rank = -(-num_samples // world_size)
    return per_rank, -(-per_rank // batch_size)
