"""Field layouts between the manifest and transforms: each kind survives the round trip."""

from __future__ import annotations

import pytest

from shardserve.proto.manifest import FieldSpec
from shardserve.server.transforms.schema import from_field_spec, to_field_spec


@pytest.mark.parametrize(
    "spec",
    [
        FieldSpec(name="label", dtype="int64"),
        FieldSpec(name="image", dtype="uint8", shape=(3, 8, 8)),
        FieldSpec(name="tokens", dtype="int32", shape=(-1,)),
        FieldSpec(name="jpeg", dtype="binary"),
    ],
    ids=["scalar", "tensor", "variable", "binary"],
)
def test_a_field_spec_survives_the_round_trip_through_a_transform_field(spec: FieldSpec) -> None:
    """A chain that outputs bytes (an encoder) gets a valid manifest field, kind binary."""
    back = to_field_spec(spec.name, from_field_spec(spec))
    assert back == spec and back.kind == spec.kind
