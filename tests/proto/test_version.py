"""A peer's protocol version is read from the message prefix, before any body is parsed."""

from __future__ import annotations

from shardserve.proto.framing import encode
from shardserve.proto.messages import PROTOCOL_VERSION, Credit
from shardserve.proto.version import mismatch_message, peek_version, speaks


def test_peek_version_reads_the_prefix_only() -> None:
    """The version comes from the 4-byte prefix of any message, even one whose body this side
    cannot parse; a frame without the magic has none."""
    assert peek_version(encode(Credit(grant=1))[0]) == PROTOCOL_VERSION
    assert peek_version(b"SS\x09\x01not json") == 9
    assert peek_version(b"XX\x01\x01") is None and peek_version(b"SS") is None
    assert speaks([PROTOCOL_VERSION, 9]) and not speaks([9])
    assert "[9]" in mismatch_message("client", [9])
