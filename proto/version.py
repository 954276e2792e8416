"""Which protocol versions meet: read a peer's version without decoding its message, and the
words of a refusal.

A Hello (and a Reject) of another version may have another body, so the version is read from
the fixed prefix (:data:`~.framing.PREFIX`) before anything is parsed.
"""

from __future__ import annotations

from collections.abc import Sequence

from .framing import MAGIC, PREFIX, Frame
from .messages import PROTOCOL_VERSION, SUPPORTED_PROTOCOLS


def peek_version(frame: Frame) -> int | None:
    """The protocol version in a header frame's prefix; ``None`` if it has no shardserve prefix.

    >>> peek_version(b"SS\\x07\\x01{}"), peek_version(b"xx")
    (7, None)
    """
    buf = memoryview(frame)
    if len(buf) < PREFIX.size:
        return None
    magic, version, _ = PREFIX.unpack_from(buf)
    return int(version) if magic == MAGIC else None


def speaks(versions: Sequence[int]) -> bool:
    """Whether this side speaks one of ``versions`` (the peer's)."""
    return PROTOCOL_VERSION in versions


def mismatch_message(peer: str, versions: Sequence[int]) -> str:
    """Why a ``peer`` ("client", "server") speaking ``versions`` cannot be served, and what to do.

    >>> mismatch_message("client", [9])  # doctest: +ELLIPSIS
    'client speaks protocol version(s) [9], this side speaks [1]: install matching ...'
    """
    return (
        f"{peer} speaks protocol version(s) {list(versions)}, this side speaks "
        f"{list(SUPPORTED_PROTOCOLS)}: install matching shardserve versions on both sides"
    )
