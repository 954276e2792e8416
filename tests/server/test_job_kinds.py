"""The table of job kinds: one row for each kind a spec can name, chosen by ``JobSpec.kind``."""

from __future__ import annotations

from dataclasses import fields
from typing import get_args

from shardserve.proto.jobs import JobKindName, JobSpec
from shardserve.server.jobs.kinds.base import KindParts
from shardserve.server.jobs.kinds.mixture import MixtureJobs
from shardserve.server.jobs.kinds.plain import PlainJobs
from shardserve.server.jobs.kinds.table import KINDS, JobKinds


def test_every_kind_a_spec_can_name_has_a_row() -> None:
    """A kind added to ``JobKindName`` without its class in the table fails here."""
    assert set(KINDS) == set(get_args(JobKindName))


def test_a_spec_gets_the_object_of_its_kind_once_built() -> None:
    """Choosing a kind uses none of the server's parts, and hands the same object each time."""
    kinds = JobKinds(KindParts(**dict.fromkeys(f.name for f in fields(KindParts))))
    plain = JobSpec(dataset="web", batch_size=8)
    mix = JobSpec(mixture=[{"name": "web", "weight": 1.0}], batch_size=8)
    assert isinstance(kinds.of(plain), PlainJobs) and isinstance(kinds.of(mix), MixtureJobs)
    assert kinds.of(plain) is kinds.of(plain.model_copy())
    assert kinds.of(mix).source_part == "source" and kinds.of(plain).source_part is None
