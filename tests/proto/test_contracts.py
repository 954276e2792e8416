"""Manifest, job spec and error contracts."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from shardserve.proto import errors
from shardserve.proto.jobs import JobSpec, job_id
from shardserve.proto.manifest import (
    FieldSpec,
    Manifest,
    ShardInfo,
    parse_manifest,
    validate_dataset_name,
)


def _manifest(**kw: object) -> dict:
    base = {
        "format_version": 1,
        "name": "cifar",
        "num_samples": 3,
        "fields": [{"name": "image", "dtype": "uint8", "shape": [3, 32, 32]}],
        "shards": [
            {"path": "shards/shard-00000.arrow", "rows": 3, "bytes": 10, "checksum": "xxh3_64:00"}
        ],
    }
    base.update(kw)
    return base


def test_manifest_round_trip() -> None:
    """A manifest survives JSON and back unchanged."""
    m = parse_manifest(json.dumps(_manifest()))
    assert parse_manifest(m.model_dump_json()) == m
    assert m.fields[0].kind == "tensor" and m.fields[0].numel == 3 * 32 * 32


def test_unknown_format_version_names_both() -> None:
    """An unknown manifest format is refused, naming the version found and the versions read."""
    with pytest.raises(errors.VersionMismatch, match=r"format_version 7 .*\[1\]"):
        parse_manifest(json.dumps(_manifest(format_version=7)))


def test_manifest_row_count_must_match() -> None:
    """num_samples must equal the shards' rows."""
    with pytest.raises(errors.InvalidDataError, match="num_samples is 5"):
        parse_manifest(json.dumps(_manifest(num_samples=5)))


@pytest.mark.parametrize("path", ["/etc/passwd", "../x.arrow", "shards/../../x", "a\\b"])
def test_shard_paths_stay_inside(path: str) -> None:
    """A shard path that could leave the dataset folder is refused."""
    with pytest.raises(ValidationError, match="relative"):
        ShardInfo(path=path, rows=1, bytes=1, checksum="x")


@pytest.mark.parametrize("name", ["../etc", "a/b", "..", ".hidden", "", "a..b", "x" * 200, "a b"])
def test_bad_dataset_names(name: str) -> None:
    """Names that could escape the store, or are not one plain component, are refused."""
    with pytest.raises(errors.InvalidDataError, match="not allowed"):
        validate_dataset_name(name)


def test_field_kinds() -> None:
    """Field kinds follow dtype and shape."""
    assert FieldSpec(name="y", dtype="int64").kind == "scalar"
    assert FieldSpec(name="x", dtype="float32", shape=(-1, 64)).kind == "variable"
    assert FieldSpec(name="b", dtype="binary").kind == "binary"
    with pytest.raises(ValidationError, match="dtype 'object'"):
        FieldSpec(name="o", dtype="object")
    with pytest.raises(ValidationError, match="binary fields"):
        FieldSpec(name="b", dtype="binary", shape=(3,))
    with pytest.raises(ValidationError, match="duplicate"):
        Manifest(
            name="d", num_samples=0, shards=(), fields=(FieldSpec(name="a", dtype="int8"),) * 2
        )


def test_job_id_is_stable_and_spec_sensitive() -> None:
    """The same spec gives the same id; any change in what decides the batches changes it."""
    a = JobSpec(dataset="cifar", batch_size=256, seed=1)
    assert job_id(a) == job_id(JobSpec(seed=1, batch_size=256, dataset="cifar"))
    assert job_id(a) == f"{job_id(JobSpec.model_validate_json(a.model_dump_json()))}"
    for change in (
        {"seed": 2},
        {"batch_size": 128},
        {"world_size": 2},
        {"shuffle": "none"},
        {"drop_last": True},
        {"fields": ("image",)},
    ):
        assert job_id(a.model_copy(update=change)) != job_id(a)
    # Fields at their defaults are left out: an envs job's id is what it was before
    # env_shuffle existed, and "split" is another job.
    envs = JobSpec(dataset="cifar", batch_size=256, envs=4, env_shuffle="independent")
    assert job_id(envs) == "4474abb4d185ff5f"  # this spec's id before env_shuffle existed
    split = envs.model_copy(update={"env_shuffle": "split"})
    assert job_id(split) != job_id(envs)


@pytest.mark.parametrize(
    "bad",
    [
        {"batch_size": 0},
        {"world_size": 0},
        {"shuffle": "random"},
        {"dataset": "../x"},
        {"fields": []},
        {"fields": ["a", "a"]},
        {"extra": 1},
    ],
)
def test_job_spec_rejects_bad_fields(bad: dict) -> None:
    """A spec with a bad field is refused with a message about that field."""
    with pytest.raises(ValidationError):
        JobSpec.model_validate({"dataset": "cifar", "batch_size": 4, **bad})


def test_error_codes_round_trip() -> None:
    """Every error class maps to a code that maps back to the same class."""
    for cls in (
        errors.DatasetCorruptError,
        errors.JobNotFound,
        errors.VersionMismatch,
        errors.AuthError,
        errors.BadRequest,
        errors.UnknownStream,
        errors.JobFailed,
    ):
        exc = errors.error_for_code(errors.code_for_error(cls("m")), "m")
        assert type(exc) is cls and str(exc) == "m"
    assert type(errors.error_for_code("no-such-code", "m")) is errors.ShardserveError
    assert errors.code_for_error(RuntimeError()) is errors.ErrorCode.INTERNAL
