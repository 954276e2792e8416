"""A shard file's bytes read as a stream, counted, never past the size it may have.

Container formats (MDS shards, LitData chunks) list each file's uncompressed size in their
index. A compressed file may lie about it either way: declare a huge size (a buffer that size
would be allocated before anything is checked) or inflate to far more than it declares (a
decompression bomb). :class:`Counted` reads the file, uncompressed or inflated as it is read,
in the pieces the reader asks for: a read past ``limit`` is refused before it is made, a
stream that goes on past its end is refused after at most :data:`CHUNK` more bytes, and the
listed hashes are checked on the bytes as they pass. So what ingest holds is what it asked
for (one sample, one table), whatever the file declares or holds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import xxhash

from shardserve.proto.errors import InvalidDataError

#: What one look past the end of a stream reads: a stream that goes on is refused after this.
CHUNK = 1 << 16
#: The most one shard file may inflate to, whatever its index says: both MDS and LitData
#: index a file's bytes with 32-bit offsets, so no real file is larger.
MAX_INFLATED_BYTES = 1 << 32
#: Codecs pyarrow inflates as a stream (snappy blocks are not streams: see :func:`open_counted`).
STREAMED = frozenset({"zstd", "gzip", "bz2", "brotli", "lz4"})
#: The most a raw snappy block can inflate per compressed byte (a 3-byte copy of 64 bytes).
SNAPPY_RATIO = 22


class Hash(Protocol):
    """An incremental hash (``hashlib`` and ``xxhash`` objects both are)."""

    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


def hash_for(algo: str) -> Hash | None:
    """A fresh hash of algorithm ``algo`` as MDSWriter names it, or ``None`` when unknown."""
    xxh = {
        "xxh32": xxhash.xxh32,
        "xxh64": xxhash.xxh64,
        "xxh128": xxhash.xxh128,
        "xxh3_64": xxhash.xxh3_64,
        "xxh3_128": xxhash.xxh3_128,
    }
    if algo in xxh:
        return xxh[algo]()
    if algo in hashlib.algorithms_available and not algo.startswith("shake_"):
        return hashlib.new(algo)
    return None


@dataclass
class Counted:
    """The bytes of ``where``, read in order: at most ``limit`` of them, each read whole or
    refused. ``produced`` counts the bytes handed out so far."""

    stream: pa.NativeFile
    limit: int
    where: str
    #: ``(algorithm, the hex digest the index lists, the running hash)``.
    hashes: list[tuple[str, str, Hash]] = field(default_factory=list)
    #: What the index that lists the file is called, for the messages.
    listed_in: str = "the index"
    produced: int = 0
    #: Bytes read from the stream and not handed out yet start at ``_at``.
    _buf: bytes = b""
    _at: int = 0

    def __enter__(self) -> Counted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.close()

    def read(self, n: int, what: str) -> memoryview:
        """The next ``n`` bytes (``what`` they are, for a refusal). The view is valid until
        the next read: a decoder copies what it keeps."""
        end = self.produced + n
        if end > self.limit:
            raise InvalidDataError(
                f"{self.where}: {what} would end at byte {end}, past the {self.limit} bytes "
                f"{self.listed_in} lists (refused after reading {self.produced}); the file is "
                "corrupt or hostile: write the dataset again"
            )
        if len(self._buf) - self._at < n:
            self._fill(n)
        have = len(self._buf) - self._at
        if have < n:
            raise InvalidDataError(
                f"{self.where}: ends at byte {self.produced + have}, inside {what} "
                f"(bytes {self.produced}..{end}); {self.listed_in} lists {self.limit}: the file "
                "is truncated or was replaced; write the dataset again"
            )
        out = memoryview(self._buf)[self._at : self._at + n]
        self._at += n
        self.produced = end
        return out

    def _fill(self, n: int) -> None:
        # Whole blocks from the stream (one call per block, not per small sample); what is
        # read past ``limit`` is at most one block, refused by ``end``.
        rest = self._buf[self._at :]
        more = self._pull(max(n - len(rest), CHUNK))
        for _, _, h in self.hashes:
            h.update(more)
        self._buf, self._at = (rest + more if rest else more), 0

    def _pull(self, n: int) -> bytes:
        try:
            return self.stream.read(n)
        except (OSError, ValueError, pa.ArrowException) as e:
            raise InvalidDataError(
                f"{self.where}: does not decompress (after {self.produced} bytes: {e}); write "
                "the dataset again"
            ) from None

    def skip(self, n: int, what: str) -> None:
        """Reads ``n`` bytes and drops them, :data:`CHUNK` at a time."""
        while n > 0:
            step = min(n, CHUNK)
            self.read(step, what)
            n -= step

    def end(self) -> None:
        """Refuses a stream with bytes past ``limit``, then a hash that differs."""
        extra = len(self._buf) - self._at or len(self._pull(CHUNK))
        if extra:
            raise InvalidDataError(
                f"{self.where}: holds more than the {self.limit} bytes {self.listed_in} lists "
                f"(refused after reading {self.produced + extra}); the file is corrupt or "
                "hostile: write the dataset again"
            )
        for algo, want, h in self.hashes:
            if h.hexdigest() != want:
                raise InvalidDataError(
                    f"{self.where}: its {algo} hash is not the one {self.listed_in} lists "
                    f"({want}): the file changed or is damaged; write the dataset again"
                )


def open_counted(path: Path, codec: str | None, limit: int, listed_in: str) -> Counted:
    """``path``'s bytes (inflated with ``codec`` when given) as a :class:`Counted` of at most
    ``limit`` bytes (the size the index lists, bounded by the caller first).

    A snappy file is one raw block that says its size first: that size must be ``limit``
    and within what snappy can inflate the file to, and then the block is inflated whole."""
    where = str(path)
    if limit > MAX_INFLATED_BYTES:
        raise InvalidDataError(
            f"{where}: {listed_in} lists {limit} bytes, more than any shard holds "
            f"({MAX_INFLATED_BYTES}: offsets are 32-bit); the index is corrupt or hostile"
        )
    try:
        raw = pa.OSFile(str(path))
        if codec is None:
            return Counted(raw, limit, where, listed_in=listed_in)
        if codec in STREAMED:
            return Counted(pa.CompressedInputStream(raw, codec), limit, where, listed_in=listed_in)
        if codec != "snappy":
            raise InvalidDataError(f"{where}: compression {codec!r} is not read")
        return Counted(_snappy(raw, limit, where, listed_in), limit, where, listed_in=listed_in)
    except (OSError, pa.ArrowException) as e:
        raise InvalidDataError(f"{where}: listed in {listed_in} but not readable ({e})") from None


def _snappy(raw: pa.NativeFile, limit: int, where: str, listed_in: str) -> pa.NativeFile:
    packed = raw.read()
    said, shift, at = 0, 0, 0
    while at < min(len(packed), 5):
        said |= (packed[at] & 0x7F) << shift
        shift, at = shift + 7, at + 1
        if not packed[at - 1] & 0x80:
            break
    if said != limit or said > SNAPPY_RATIO * len(packed):
        raise InvalidDataError(
            f"{where}: a {len(packed)}-byte snappy block that says it holds {said} bytes; "
            f"{listed_in} lists {limit}: the file is corrupt or hostile"
        )
    try:
        return pa.BufferReader(pa.decompress(packed, decompressed_size=limit, codec="snappy"))
    except (OSError, ValueError, pa.ArrowException) as e:
        raise InvalidDataError(f"{where}: does not decompress (snappy: {e})") from None
