"""A peer's protocol version is read from the message prefix, before any body is parsed."""

from __future__ import annotations

import pytest

from shardserve.proto.errors import VersionMismatch
from shardserve.proto.framing import encode
from shardserve.proto.messages import PROTOCOL_VERSION, Credit, Kind
from shardserve.proto.version import check_version, foreign_hello, peek_version


def test_peek_version_reads_the_prefix_only() -> None:
    """The version comes from the prefix of any message, even one whose body this side cannot
    parse; a message too short to carry one has none."""
    assert peek_version(encode(Credit(grant=1))) == PROTOCOL_VERSION
    assert peek_version([b"SS\x09\x01not json"]) == 9
    assert peek_version([b"SS"]) is None and peek_version([]) is None


def test_only_self_describing_kinds_pass_another_version() -> None:
    """A Hello of another version is explained (its body may differ); a Credit is refused."""
    check_version(9, Kind.HELLO)
    with pytest.raises(VersionMismatch, match="protocol 9"):
        check_version(9, Kind.CREDIT)
    assert foreign_hello([b"SS\x09\x01{}"], Kind.HELLO) == 9
    assert foreign_hello(encode(Credit(grant=1)), Kind.CREDIT) is None
