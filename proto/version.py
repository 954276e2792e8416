"""The data-plane protocol version as the first frame carries it. Pure functions.

Every message's header frame starts ``b"SS" | version (u8) | kind (u8)`` (see
:mod:`.framing`). Hello and Reject carry their versions in the body too, so a peer of another
version is told which versions each side speaks instead of failing to parse; every other
kind must be of this side's version.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import VersionMismatch
from .messages import PROTOCOL_VERSION, Kind

#: Byte offset of the version in a header frame (after the 2-byte magic).
VERSION_OFFSET = 2
#: Kinds whose body names the versions a side speaks: a mismatch in them is explained.
SELF_DESCRIBING = frozenset({Kind.HELLO, Kind.REJECT})

HeaderFrame = bytes | bytearray | memoryview


def peek_version(frames: Sequence[HeaderFrame]) -> int | None:
    """The protocol version a message was written in, or ``None`` if it has no header frame
    long enough to say.

    >>> peek_version([b"SS\\x01\\x01{}"])
    1
    >>> peek_version([b"S"]) is None
    True
    """
    if not frames:
        return None
    head = memoryview(frames[0])
    if head.nbytes <= VERSION_OFFSET:
        return None
    return int(head.cast("B")[VERSION_OFFSET])


def check_version(version: int | None, kind: Kind) -> None:
    """Raise :class:`VersionMismatch` for a message of ``kind`` written in another version
    (Hello and Reject excepted: their bodies say which versions the peer speaks)."""
    if version != PROTOCOL_VERSION and kind not in SELF_DESCRIBING:
        raise VersionMismatch(
            f"peer speaks protocol {version}, this side speaks {PROTOCOL_VERSION}"
        )


def foreign_hello(frames: Sequence[HeaderFrame], kind: Kind) -> int | None:
    """The version of a Hello written in another protocol version (its body may differ, so it
    is explained rather than parsed), or ``None`` for anything else."""
    version = peek_version(frames)
    if kind is Kind.HELLO and version != PROTOCOL_VERSION:
        return version
    return None
