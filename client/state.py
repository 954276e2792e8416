"""Checking a ``Loader.state_dict()`` before resuming from it, on any world size.

A state dict comes back from a checkpoint file that may be from another version, another job,
hand-edited or damaged. Every problem is one ``BadRequest`` that names the key, what it held
and what was expected, instead of a ``KeyError`` or a raw pydantic dump.

What a state says (version 2): the epoch in progress and its **position**, how many ids of the
epoch's one global order every rank together has consumed (see :mod:`shardserve.proto.resume`),
plus the world size and spec it was saved with. Under DDP every rank has received the same
number of batches, so every rank's state says the same position and any one of them (rank
0's, all that Lightning and Accelerate checkpoint) resumes the whole job, on the same or any
other world size. A list of every rank's states is accepted too: it must be one state per rank
``0 .. N-1`` of one world size, all at the same epoch and position, else it is refused.
Version 1 states (no position) are read as ``position = next_batch * batch * world_size``.

What a state was taken on: its ``versions`` (the dataset version(s) its job read) or, in
states saved before that key, its ``job`` id, which covers the pinned version(s): the id this
Loader's own job has at the state's world size is the state's id exactly when the state was
taken on this version. A state matched by neither (version 1 states carry no job id) is
refused mid-epoch, as is one of another version, unless the caller resumes knowingly
(``allow_other_version``); at an epoch's start nothing of the epoch was consumed, so it loads.
A mixture's state resumes on its own world size only: its weight changes are journaled on the
job of that world size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import JobSpec, deal_world, job_id
from shardserve.proto.messages import MAX_REPORTED_COUNT
from shardserve.proto.resume import ResumePoint, resume_point

from ._position import Start

#: What ``state_dict()`` writes; every version in :data:`READS` loads.
VERSION = 2
READS = (1, 2)
KEYS = ("version", "spec", "epoch", "next_batch", "rank", "world_size")
#: Longest ``versions`` a state may carry (a mixture's ``name@version`` of up to 64 sources).
MAX_VERSIONS_CHARS = 1 << 14
#: Epochs a Hello can carry.
MAX_EPOCH = (1 << 31) - 1
#: The argument of ``load_state_dict`` that resumes a state on another dataset version.
ALLOW = "allow_other_version=True"


class ResumeRefused(BadRequest):
    """A state dict that would not resume exactly here: taken on another dataset version, on
    a version it cannot be matched to, or (a mixture) on another world size. Raised by
    ``load_state_dict`` before any batch; the message says what to do."""


@dataclass(frozen=True)
class ResumeState:
    """The checked contents of a state dict."""

    spec: JobSpec
    epoch: int
    next_batch: int
    rank: int
    world_size: int
    #: Ids of the epoch's order consumed by every rank together (see the module docstring).
    position: int
    #: The server's id of the job that saved it (``""`` in version 1 states).
    job: str = ""
    #: The dataset version(s) that job read (``JobSpec.versions``; ``""`` in older states).
    versions: str = ""

    @property
    def batch(self) -> int:
        """Samples of one rank's batch of one environment: the unit of the position."""
        return self.spec.env_batch


def _int(state: Mapping[str, Any], key: str, low: int = 0, high: int = MAX_REPORTED_COUNT) -> int:
    v = state[key]
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise BadRequest(
            f"state dict key {key!r} is {v!r}; expected an integer {low} <= {key} <= {high}"
        )
    return v


def parse_state(state: object, version: int = VERSION) -> ResumeState:
    """The checked state, or ``BadRequest`` saying what is wrong with it. ``version``: the
    newest this reader writes (any of :data:`READS` up to it loads)."""
    if not isinstance(state, Mapping):
        raise BadRequest(
            f"a state dict must be the dict Loader.state_dict() returned, got {type(state).__name__}"
        )
    missing = [k for k in KEYS if k not in state]
    if missing:
        raise BadRequest(
            f"state dict lacks key(s) {missing}; pass the dict Loader.state_dict() returned"
        )
    got = state["version"]
    if isinstance(got, bool) or got not in READS or got > version:
        readable = [v for v in READS if v <= version]
        raise BadRequest(f"state version {got!r}; this client reads versions {readable}")
    spec = _spec_of(state)
    world_size = _int(state, "world_size", 1, MAX_REPORTED_COUNT)
    rank = _int(state, "rank")
    if rank >= world_size:
        raise BadRequest(f"state dict rank {rank} out of range 0 <= rank < {world_size}")
    if world_size != spec.world_size:
        raise BadRequest(
            f"state dict key 'world_size' is {world_size} but its spec says world_size "
            f"{spec.world_size}; the state was edited or mixed up"
        )
    epoch = _int(state, "epoch", 0, MAX_EPOCH)
    next_batch = _int(state, "next_batch")
    position, job = _position_and_job(state, got, spec, next_batch)
    versions = state.get("versions", "")
    if not isinstance(versions, str) or len(versions) > MAX_VERSIONS_CHARS:
        raise BadRequest(f"state dict key 'versions' is {versions!r}; expected the version string")
    return ResumeState(spec, epoch, next_batch, rank, world_size, position, job, versions)


def _spec_of(state: Mapping[str, Any]) -> JobSpec:
    """The state's job spec, checked as the server checks one."""
    if not isinstance(state["spec"], Mapping):
        raise BadRequest(f"state dict key 'spec' is {state['spec']!r}; expected the job spec dict")
    try:
        return JobSpec.model_validate(dict(state["spec"]))
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'spec'}: {err['msg']}" for err in e.errors()
        )
        raise BadRequest(f"state dict key 'spec' is not a valid job spec: {problems}") from None


def _position_and_job(
    state: Mapping[str, Any], version: int, spec: JobSpec, next_batch: int
) -> tuple[int, str]:
    """The state's global position, checked against ``next_batch``, and the id of the job
    that saved it; a version 1 state has neither: its position is ``next_batch``'s start."""
    step = spec.env_batch * spec.deal_world
    if version == 1:
        return next_batch * step, ""
    position = _int(state, "position")
    if position // step != next_batch:
        world_size = spec.world_size
        raise BadRequest(
            f"state dict keys 'position' ({position}) and 'next_batch' ({next_batch}) "
            f"disagree: position {position} is batch {position // step} of {world_size} "
            f"ranks of {step // world_size}; pass the dict Loader.state_dict() returned"
        )
    job = state.get("job", "")
    if not isinstance(job, str) or len(job) > 64:
        raise BadRequest(f"state dict key 'job' is {job!r}; expected a job id string")
    return position, job


def parse_states(states: object, version: int = VERSION) -> ResumeState:
    """One state, or the states of every rank of one job (a list): checked to agree, since
    resuming from ranks that consumed different numbers of batches would lose or repeat
    samples. ``BadRequest`` names the first disagreement."""
    if isinstance(states, Mapping):
        return parse_state(states, version)
    if not isinstance(states, Sequence) or isinstance(states, (str, bytes)) or not states:
        raise BadRequest(
            "a state dict must be the dict Loader.state_dict() returned (or a non-empty list "
            f"of every rank's), got {type(states).__name__}"
        )
    parsed = [parse_state(s, version) for s in states]
    first = parsed[0]
    ranks = sorted(p.rank for p in parsed)
    if ranks != list(range(first.world_size)):
        raise BadRequest(
            f"a list of states must hold one state of each rank 0..{first.world_size - 1} of "
            f"the world it was saved on; got ranks {ranks}"
        )
    for p in parsed[1:]:
        for key in ("spec", "world_size", "epoch", "position", "job", "versions"):
            if getattr(p, key) != getattr(first, key):
                raise BadRequest(
                    f"the states disagree on {key!r}: rank {first.rank} has "
                    f"{getattr(first, key)!r}, rank {p.rank} has {getattr(p, key)!r}; the ranks "
                    "of one job must be saved at the same step (as DDP keeps them)"
                )
    return first


def check_resumable(
    st: ResumeState,
    spec: JobSpec,
    pinned: JobSpec,
    world_size: int,
    what: str,
    allow_other_version: bool = False,
) -> None:
    """Refuse ``st`` unless it resumes exactly in this ``what`` ("loader" or "plan"), whose
    spec is ``spec``, whose job the server pinned as ``pinned`` and which runs on
    ``world_size`` ranks: ``BadRequest`` for another job's state, :class:`ResumeRefused` for
    one of another (or an unknown) dataset version, unless ``allow_other_version``, and for a
    mixture's state of another world size."""
    check_same_job(st, spec, what)
    if spec.mixture is not None and st.world_size != world_size:
        raise ResumeRefused(
            f"state dict was saved by a mixture job on {st.world_size} ranks, and this {what} "
            f"runs on {world_size}: a mixture cannot resume on another world size yet (its "
            f"weight changes are journaled on the job of {st.world_size} ranks, and its plan "
            f"is not dealt from a position). Resume on world_size={st.world_size}, or start "
            f"epoch {st.epoch} again on {world_size} ranks (do not load the state: "
            f"{what}.set_epoch({st.epoch}))"
        )
    # At an epoch's start nothing of the epoch was consumed: no two versions can meet in it.
    if st.position == 0:
        return
    check_scheme(st, pinned, what)
    if not allow_other_version:
        check_version(st, pinned, what)


def check_scheme(st: ResumeState, pinned: JobSpec, what: str) -> None:
    """:class:`ResumeRefused` if ``st`` was taken mid-epoch by a job whose transforms drew by
    randomness scheme 1 (its job id is this job's without ``transform_rng``) and this job
    draws by another: the rest of the epoch would be augmented differently."""
    if not st.job or pinned.transform_rng is None or st.job == saved_job_id(st, pinned):
        return
    if st.job != saved_job_id(st, pinned.model_copy(update={"transform_rng": None})):
        return
    raise ResumeRefused(
        f"state was saved at position {st.position} of epoch {st.epoch} by job {st.job}, whose "
        "transforms drew their random numbers by scheme 1 (a server from before randomness "
        f"schemes were recorded); this {what}'s job draws by scheme {pinned.transform_rng}, so "
        f"the rest of epoch {st.epoch} would be augmented differently. Start epoch {st.epoch} "
        f"again (do not load the state: {what}.set_epoch({st.epoch})), or finish the epoch on "
        "the shardserve version that saved the state"
    )


def check_same_job(st: ResumeState, spec: JobSpec, what: str) -> None:
    """``BadRequest`` unless ``st`` was saved by ``spec``'s job at some world size, shared or
    not (a share group's batches are the unshared job's)."""
    saved = st.spec.model_copy(update={"world_size": spec.world_size, "share": spec.share})
    if saved != spec:
        old, new = saved.model_dump(mode="json"), spec.model_dump(mode="json")
        diff = "; ".join(
            f"{k}={old[k]!r} in the state, {new[k]!r} in this {what}"
            for k in old
            if old[k] != new[k]
        )
        raise BadRequest(
            f"state is for another job ({diff}); load it into a {what} made with the same "
            "arguments (world_size may differ)"
        )


def check_version(st: ResumeState, pinned: JobSpec, what: str) -> None:
    """:class:`ResumeRefused` unless ``st`` was taken on the dataset version(s) of the job
    ``pinned``: a position counts samples of one version's order, so on another version it
    would resume in the middle of different data. Matched by the state's ``versions``, else
    by its job id (see the module docstring)."""
    reads = _pinned_versions(pinned)
    if st.versions:
        if st.versions == reads:
            return
        taken = f"was saved on dataset {pinned.dataset!r} version {st.versions}"
    elif st.job and reads and st.job == saved_job_id(st, pinned):
        return
    elif st.job:
        taken = (
            f"has no 'versions' key (saved before states recorded it, or edited), and its job "
            f"{st.job} is not the job of this {what}'s version at the state's world size "
            f"{st.world_size} ({saved_job_id(st, pinned)}): it was taken on another version of "
            f"dataset {pinned.dataset!r} (or by a job made before jobs pinned a version)"
        )
    else:
        taken = (
            "names neither the dataset version nor the job it was taken on (a version 1 state, "
            f"or one edited): it cannot be matched to a version of dataset {pinned.dataset!r}"
        )
    raise ResumeRefused(
        f"state {taken}, but this {what}'s job reads version "
        f"{reads or 'unknown (the server pinned none)'}: resumed at position {st.position} of "
        f"epoch {st.epoch}, one epoch could mix two versions of the data. Start epoch "
        f"{st.epoch} again (do not load the state: {what}.set_epoch({st.epoch})), or resume "
        f"at that position on this version knowingly: {what}.load_state_dict(state, {ALLOW})"
    )


def saved_job_id(st: ResumeState, pinned: JobSpec) -> str:
    """The id of the job that saved ``st`` if it was taken on ``pinned``'s version(s): the
    job id covers the pinned version(s), the world size and the share group."""
    return job_id(pinned.model_copy(update={"world_size": st.world_size, "share": st.spec.share}))


def _pinned_versions(pinned: JobSpec) -> str:
    """The version(s) ``pinned`` reads as states record them; ``""`` when the server pinned
    none (such a job serves whatever is current, so no state can be matched to it)."""
    pins = [s.version for s in pinned.mixture] if pinned.mixture else [pinned.version]
    return pinned.versions if all(pins) else ""


def resume_at(st: ResumeState, world_size: int) -> ResumePoint:
    """Where a rank of ``world_size`` starts: ``st.position`` dealt over ``world_size`` ranks
    (and their environments, when they split one shuffle)."""
    world = deal_world(world_size, st.spec.envs, st.spec.env_shuffle)
    return resume_point(st.position, world, st.batch)


def make_state(
    spec_dump: dict[str, Any], job: str, rank: int, world_size: int, start: Start, versions: str
) -> dict[str, Any]:
    """The dict ``state_dict()`` returns for a rank whose next iteration starts at ``start``
    of job ``job``, which reads dataset version(s) ``versions``. ``spec_dump`` is used as is:
    the caller passes a copy of its own."""
    envs = spec_dump.get("envs", 1)
    world = deal_world(world_size, envs, spec_dump.get("env_shuffle", "independent"))
    step = spec_dump["batch_size"] // envs * world
    return {
        "version": VERSION,
        "spec": spec_dump,
        "job": job,
        "epoch": start.epoch,
        "next_batch": start.batch,
        "position": start.offset + start.batch * step,
        "rank": rank,
        "world_size": world_size,
        "versions": versions,
    }


def start_for(
    st: ResumeState, world_size: int, num_samples: int, num_batches: int
) -> tuple[Start, str]:
    """Where a rank of ``world_size`` resumes ``st`` (of a job of ``num_samples`` samples and
    ``num_batches`` batches a rank) and the saving job's id when the world size changed (the
    link a resumed job shows), else ``""``."""
    step = st.batch * st.spec.deal_world
    if st.world_size == world_size:  # the plan it was streaming, at the batch it was at
        return Start(st.epoch, st.next_batch, st.position - st.next_batch * step), ""
    # An honest position is below n + 2 * step (at most one round of batches past the end).
    if st.position >= num_samples + 2 * step:
        raise BadRequest(
            f"state dict key 'position' is {st.position}, beyond the {num_samples} samples of "
            "an epoch of this job; pass the dict Loader.state_dict() returned"
        )
    if st.position >= num_samples:  # every sample of the epoch was consumed: nothing is left
        return Start(st.epoch, num_batches), st.job
    point = resume_at(st, world_size)
    return Start(st.epoch, point.start_batch, point.offset), st.job
