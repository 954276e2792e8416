"""The shared-memory slot ring as both sides see it: where rings live, how they are named,
how a ring file is cut into slots and parts, and what either side refuses.

The server makes and owns a ring (``shardserve.server.streaming.shm``); the client maps it
and reads slots in place (``shardserve.client.shm``). Both lay a ring out by these rules,
so they are written once, here, as pure functions: no mapping, no numpy.

A ring is one file ``<dir>/shardserve-<pid>-<stream>-<random>`` of ``slots`` equal slots of
``slot_bytes`` each (a multiple of :data:`ALIGN`); slot ``k`` starts at byte
``k * slot_bytes``; each part lies at its header's ``offset`` inside its slot.

>>> slot_bytes = align(1000)
>>> slot_bytes
1024
>>> ring_bytes(4, slot_bytes), slot_start(2, 4, slot_bytes)
(4096, 2048)
>>> part_fits(1000, 24, slot_bytes), part_fits(1000, 25, slot_bytes)
(True, False)
>>> plain_name(ring_name(7, 1, "ab12cd34")), plain_name("../etc/passwd")
(True, False)
"""

from __future__ import annotations

from pathlib import Path

#: Where rings are made and looked for: a tmpfs on Linux (``--shm-size`` in Docker).
DEFAULT_DIR = Path("/dev/shm")
#: Every ring's file name starts with this (a sweep of stale rings looks for nothing else).
PREFIX = "shardserve-"
#: Each part starts on a cache line so views are aligned for any dtype and for DMA.
ALIGN = 64


class SlotOutOfRange(IndexError, ValueError):
    """A slot number outside the ring: an ``IndexError`` to the server's slot views, a
    ``ValueError`` (a bad header) to the client reading a batch."""


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def ring_name(pid: int, stream: int, token: str) -> str:
    """The file name of stream ``stream``'s ring made by server process ``pid``; ``token``
    (random hex) keeps the rings of one stream number apart."""
    return f"{PREFIX}{pid}-{stream}-{token}"


def plain_name(name: str) -> bool:
    """Whether ``name`` is a plain file name a client may open in the ring directory (no
    path separator, not hidden: a ring is hidden only while the server makes it)."""
    return "/" not in name and not name.startswith(".")


def ring_bytes(slots: int, slot_bytes: int) -> int:
    """The size of a ring file of ``slots`` slots of ``slot_bytes``."""
    return slots * slot_bytes


def slot_start(slot: int, slots: int, slot_bytes: int) -> int:
    """The byte at which ``slot`` starts in its ring file; :class:`SlotOutOfRange` when the
    ring has no such slot."""
    if not 0 <= slot < slots:
        raise SlotOutOfRange(f"slot {slot} out of range 0 <= slot < {slots}")
    return slot * slot_bytes


def part_fits(offset: int, nbytes: int, slot_bytes: int) -> bool:
    """Whether a part of ``nbytes`` at ``offset`` in its slot stays inside the slot."""
    return offset + nbytes <= slot_bytes
