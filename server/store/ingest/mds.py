"""Read MosaicML Streaming's MDS format: a folder with ``index.json`` and ``shard.NNNNN.mds``
files (compressed ones end in ``.zstd``, ``.gz``...), as ``MDSWriter`` writes them.

Read here without importing ``streaming`` (its import pulls torch, transformers and
torchvision; the server never imports torch). The format is small: the index lists each
shard's columns (name, encoding, fixed size or none), its sample count, its files and their
hashes; a shard is ``uint32 n``, ``uint32 offsets[n + 1]`` (from the file's start) and the
samples, each a ``uint32`` size per variable-size column and then the columns' bytes in the
index's order.

Each encoding comes back as ``StreamingDataset`` gives it, except images: ``jpeg`` / ``png``
columns stay their encoded bytes (the ``decode_image`` transform reads them), and a ``pil``
column (raw pixels) is its pixel array, ``np.asarray(image)``. ``str_decimal`` is kept as
its text. Pickled columns (``pkl``) are refused, never loaded; so are lists of images.
Listed hashes are checked (an algorithm Streaming does not write is named in the summary as
not checked). A shard is read as a counted stream (:mod:`.inflate`), one sample at a time:
its offsets are checked as they arrive, and no shard is inflated past the size listed.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardserve.proto.errors import InvalidDataError

from .decode import as_value
from .inflate import CHUNK, Counted, Hash, hash_for, open_counted
from .raw import pil_pixels, utf8
from .source import MAX_SAMPLE_BYTES, IngestSource, Piece, Reader, listed_file

INDEX = "index.json"

#: Fixed-size numeric encodings: one value of this dtype (``StreamingDataset`` gives a numpy
#: scalar, kept here with its dtype).
SCALARS: dict[str, np.dtype[Any]] = {
    name: np.dtype(name)
    for name in (
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    )
}

#: The ``ndarray`` encoding's dtype codes (one byte, when the index does not fix the dtype).
NDARRAY_DTYPES: dict[int, str] = {
    8: "uint8",
    9: "int8",
    16: "uint16",
    17: "int16",
    18: "float16",
    32: "uint32",
    33: "int32",
    34: "float32",
    64: "uint64",
    65: "int64",
    66: "float64",
}

#: The compression families (the part of ``zstd:7`` before the level) and pyarrow's codec.
CODECS = {"zstd": "zstd", "gz": "gzip", "bz2": "bz2", "br": "brotli", "snappy": "snappy"}

_IMAGE_LISTS = (
    "is a list of images, which ingest does not read; write each image as its own column or "
    "as bytes"
)
#: Encodings refused, and why (each error names the column and what to write instead).
REFUSED = {
    "pkl": "is pickled and is never unpickled; write it with another encoding "
    "(ndarray, json, str, bytes...)",
    **dict.fromkeys(
        ("list[pil]", "list[jpeg]", "list[png]", "jpeg_array", "jpegarray"), _IMAGE_LISTS
    ),
}


@dataclass(frozen=True)
class Column:
    name: str
    encoding: str
    #: Bytes per sample when fixed (the index's ``column_sizes``), else ``None``.
    size: int | None
    decode: Callable[[memoryview, str], object]


def _decoder(encoding: str, where: str) -> Callable[[memoryview, str], object]:
    """The function that turns one column's bytes into a sample value, or a clear refusal."""
    if encoding in REFUSED:
        raise InvalidDataError(f"{where} {REFUSED[encoding]}")
    if encoding in SCALARS:
        dt = SCALARS[encoding]
        return lambda b, w: np.frombuffer(b, dt, count=1).reshape(()).copy()
    if encoding == "ndarray" or encoding.startswith("ndarray:"):
        return _ndarray_decoder(encoding, where)
    plain: dict[str, Callable[[memoryview, str], object]] = {
        "bytes": lambda b, w: bytes(b),
        "jpeg": lambda b, w: bytes(b),
        "png": lambda b, w: bytes(b),
        "str": utf8,
        "str_decimal": utf8,
        "str_int": lambda b, w: int(utf8(b, w)),
        "str_float": lambda b, w: float(utf8(b, w)),
        "int": lambda b, w: int(np.frombuffer(b, "<i8", count=1)[0]),
        "json": lambda b, w: as_value(bytes(b), w, "json"),
        "pil": pil_pixels,
    }
    if encoding not in plain:
        raise InvalidDataError(
            f"{where} has the encoding {encoding!r}, which ingest does not read (it reads "
            f"{', '.join(sorted([*plain, *SCALARS, 'ndarray']))}); write it with one of those"
        )
    return plain[encoding]


def _ndarray_decoder(encoding: str, where: str) -> Callable[[memoryview, str], object]:
    """``ndarray``, ``ndarray:DTYPE`` or ``ndarray:DTYPE:D0,D1``: what the index fixes is not
    stored per sample; the rest (a dtype code byte, an ndim/shape-width byte and the shape)
    is."""
    args = encoding.split(":")[1:]
    fixed_dtype = args[0] if args else None
    if fixed_dtype is not None and fixed_dtype not in NDARRAY_DTYPES.values():
        raise InvalidDataError(f"{where}: unknown ndarray dtype {fixed_dtype!r} in {encoding!r}")
    fixed_shape = tuple(int(d) for d in args[1].split(",")) if len(args) > 1 else None

    def decode(b: memoryview, w: str) -> np.ndarray:
        i = 0
        try:
            if fixed_dtype is None:
                dtype = NDARRAY_DTYPES[b[i]]
                i += 1
            else:
                dtype = fixed_dtype
            if fixed_shape is None:
                ndim, width = b[i] >> 2, 1 << (b[i] & 3)
                i += 1
                shape = tuple(int(d) for d in np.frombuffer(b, f"<u{width}", count=ndim, offset=i))
                i += ndim * width
            else:
                shape = fixed_shape
            arr = np.frombuffer(b, dtype, offset=i)
            return arr.reshape(shape).copy()
        except (KeyError, IndexError, ValueError) as e:
            raise InvalidDataError(f"{w}: not a valid {encoding!r} value ({e})") from None

    return decode


@dataclass(frozen=True)
class Shard:
    index: Path
    raw_name: str
    raw_bytes: int
    raw_info: dict[str, Any]
    zip_info: dict[str, Any] | None
    codec: str | None
    samples: int
    columns: tuple[Column, ...]

    @property
    def path(self) -> Path:
        name = self.zip_info["basename"] if self.zip_info else self.raw_name
        return self.index.parent / name


def _count(value: object, where: str, field: str, what: str) -> int:
    """``value`` if it is a whole number >= 0; else a one-line refusal naming the field."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidDataError(
            f"{where}: {field} is {value!r}; it must be {what}: write the dataset again with "
            "MDSWriter, or correct the index"
        )
    return value


def _columns(s: dict[str, Any], where: str) -> tuple[Column, ...]:
    names, encodings, sizes = s["column_names"], s["column_encodings"], s["column_sizes"]
    if not (
        isinstance(names, list)
        and isinstance(encodings, list)
        and isinstance(sizes, list)
        and len(names) == len(encodings) == len(sizes)
    ):
        raise InvalidDataError(
            f"{where}: column_names, column_encodings and column_sizes must be lists of one "
            f"length (got {names!r}, {encodings!r}, {sizes!r})"
        )
    cols = []
    for n, e, z in zip(names, encodings, sizes, strict=True):
        at = f"{where} column {n!r}"
        if z is not None:
            z = _count(z, at, "its column_sizes entry", "a byte count >= 0, or null (variable)")
        cols.append(Column(str(n), str(e), z, _decoder(str(e), at)))
    return tuple(cols)


def _codec(s: dict[str, Any], where: str) -> str | None:
    comp = s.get("compression")
    if not comp:
        return None
    family = str(comp).split(":")[0]
    if family not in CODECS:
        raise InvalidDataError(f"{where}: unknown compression {comp!r}")
    return CODECS[family]


def _shard(index: Path, s: dict[str, Any], where: str) -> Shard:
    if s.get("format") != "mds" or s.get("version") != 2:
        raise InvalidDataError(
            f"{where}: format {s.get('format')!r} version {s.get('version')!r}; ingest "
            "reads MDS version 2 (write it with MDSWriter, or convert it)"
        )
    cols = _columns(s, where)
    codec = _codec(s, where)
    raw = s["raw_data"]
    for info in (raw, s.get("zip_data") or {}):
        name = str(info.get("basename", ""))
        if "basename" in info and (Path(name).name != name or name in ("", ".", "..")):
            # A shard is a file beside its index: a path is never followed out of it.
            raise InvalidDataError(f"{where}: basename {name!r} is not a file name beside {INDEX}")
    raw_bytes = _count(raw["bytes"], where, "raw_data.bytes", "a byte count >= 0")
    samples = _count(s["samples"], where, "samples", "a sample count >= 0")
    shard = Shard(
        index, str(raw["basename"]), raw_bytes, raw, s.get("zip_data"), codec, samples, cols
    )
    # The file read is in the index's folder: a link out of it is refused, not followed.
    listed_file(index.parent, shard.path.name, index)
    return shard


def _shards(index: Path) -> list[Shard]:
    try:
        obj = json.loads(index.read_text())
        entries = obj["shards"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidDataError(f"{index}: not an MDS index ({e})") from None
    shards: list[Shard] = []
    seen: dict[str, int] = {}
    for k, s in enumerate(entries):
        where = f"{index} shard {k}"
        try:
            shard = _shard(index, s, where)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidDataError(
                f"{where}: not a valid MDS shard entry ({type(e).__name__}: {e})"
            ) from None
        name = shard.path.name
        if name in seen:
            # Listed twice, its samples would be ingested twice: never silently repeated.
            raise InvalidDataError(
                f"{index} lists the shard {name} twice (shards {seen[name]} and {k}); each "
                "shard is listed once: remove the repeated entry"
            )
        seen[name] = k
        shards.append(shard)
    return shards


def _open_shard(shard: Shard, max_sample_bytes: int, unchecked: set[str]) -> Counted:
    """The shard's uncompressed bytes as a stream, every size bounded before it is read:
    the declared size by the samples it holds, the file by the size the index lists."""
    path = shard.path
    # An honest shard holds at most its samples (and their offsets): a larger declared size
    # is refused before a byte is read.
    bound = shard.samples * (max_sample_bytes + 4) + 8
    if shard.raw_bytes > bound:
        raise InvalidDataError(
            f"{path}: {INDEX} declares {shard.raw_bytes} bytes for {shard.samples} samples, more "
            f"than --max-sample-bytes ({max_sample_bytes}) allows per sample"
        )
    try:
        size = path.stat().st_size
    except OSError as e:
        raise InvalidDataError(f"{path}: listed in {INDEX} but not readable ({e})") from None
    on_disk = shard.zip_info or shard.raw_info
    want = shard.raw_bytes if shard.zip_info is None else shard.zip_info.get("bytes", size)
    if size != want:
        raise InvalidDataError(
            f"{path}: {size} bytes, {INDEX} lists {want}: the file is truncated or was "
            "replaced; write the dataset again"
        )
    # The file on disk is hashed before any sample is read (a damaged file is named as such,
    # not by the first sample it breaks); the inflated bytes of a compressed one as they
    # come out, checked at its end.
    with open_counted(path, None, size, INDEX) as whole:
        whole.hashes = _hashes(on_disk, unchecked)
        whole.skip(size, "its bytes")
        whole.end()
    src = open_counted(path, shard.codec, shard.raw_bytes, INDEX)
    if shard.zip_info is not None:
        src.hashes = _hashes(shard.raw_info, unchecked)
    return src


def _hashes(info: dict[str, Any], unchecked: set[str]) -> list[tuple[str, str, Hash]]:
    out = []
    for algo, want in sorted((info.get("hashes") or {}).items()):
        h = hash_for(algo)
        if h is None:
            unchecked.add(algo)
        else:
            out.append((algo, str(want), h))
    return out


def _offsets(shard: Shard, src: Counted, max_sample_bytes: int) -> np.ndarray:
    """The shard's ``n + 1`` sample offsets, read and checked a block at a time (in order,
    inside the declared size, each sample within ``max_sample_bytes``): a header of zeros
    or lies is refused at its first wrong block, not after the shard is inflated."""
    path, n, total = shard.path, shard.samples, shard.raw_bytes
    head = 4 * (n + 2)
    (got,) = struct.unpack("<I", src.read(4, "its sample count")) if total >= head else (None,)
    if got != n:
        raise InvalidDataError(
            f"{path}: does not begin with its {n} samples' offsets (refused after reading "
            f"{src.produced} of the {total} bytes {INDEX} lists)"
        )
    # 32-bit, as stored: 4 bytes a sample, filled only as far as valid offsets arrive.
    offsets = np.empty(n + 1, np.uint32)
    prev, block = head, CHUNK // 4
    for lo in range(0, n + 1, block):
        part = np.frombuffer(src.read(4 * min(block, n + 1 - lo), "its sample offsets"), "<u4")
        steps = np.diff(part.astype(np.int64), prepend=prev)
        sizes = steps[1:] if lo == 0 else steps
        if steps.min() < 0 or part.max() > total:
            raise InvalidDataError(
                f"{path}: its sample offsets are out of order or out of the file (refused "
                f"after reading {src.produced} of the {total} bytes {INDEX} lists)"
            )
        if sizes.size and sizes.max() > max_sample_bytes:
            i = lo + int(np.argmax(sizes)) - (0 if lo == 0 else 1)
            raise InvalidDataError(
                f"{path} sample {i}: {int(sizes.max())} bytes, more than --max-sample-bytes "
                f"({max_sample_bytes})"
            )
        offsets[lo : lo + part.size] = part
        prev = int(part[-1])
    if int(offsets[-1]) != total:
        raise InvalidDataError(
            f"{path}: its samples end at byte {offsets[-1]}, {INDEX} lists {total}: the file "
            "is truncated or was replaced; write the dataset again"
        )
    return offsets


def _samples(shard: Shard, src: Counted, max_sample_bytes: int) -> Iterator[Piece]:
    offsets = _offsets(shard, src, max_sample_bytes)
    src.skip(int(offsets[0]) - 4 * (shard.samples + 2), "the gap before its first sample")
    variable = [c for c in shard.columns if c.size is None]
    path = shard.path  # a Path join: once, not per sample
    for i in range(shard.samples):
        where = f"{path} sample {i}"
        blob = src.read(int(offsets[i + 1]) - int(offsets[i]), f"sample {i}")
        var_sizes = iter(np.frombuffer(blob, "<u4", count=len(variable)).tolist())
        at = 4 * len(variable)
        sample: dict[str, object] = {}
        for col in shard.columns:
            size = col.size if col.size is not None else next(var_sizes)
            if at + size > len(blob):
                raise InvalidDataError(f"{where}: column {col.name!r} runs past the sample's end")
            sample[col.name] = col.decode(blob[at : at + size], f"{where} column {col.name!r}")
            at += size
        if at != len(blob):
            raise InvalidDataError(f"{where}: {len(blob) - at} bytes after its last column")
        yield Piece(where=where, sample=sample)


def _pieces(shards: list[Shard], source: IngestSource, max_sample_bytes: int) -> Iterator[Piece]:
    unchecked: set[str] = set()
    index = shards[0].index
    yield Piece(where=str(index), files=1, nbytes=index.stat().st_size)
    for shard in shards:
        with _open_shard(shard, max_sample_bytes, unchecked) as src:
            yield from _samples(shard, src, max_sample_bytes)
            src.end()
        yield Piece(where=str(shard.path), files=1, nbytes=shard.path.stat().st_size)
    if unchecked:
        source.metadata["hashes"] = (
            f"{', '.join(sorted(unchecked))} listed but not checked (an unknown algorithm)"
        )


def open_mds(src: Path, threads: int = 1, max_sample_bytes: int = MAX_SAMPLE_BYTES) -> IngestSource:
    """A source over the MDS dataset at ``src`` (its folder or its ``index.json``)."""
    index = src if src.is_file() else src / INDEX
    shards = _shards(index)
    if not shards:
        raise InvalidDataError(f"{index}: lists no shards; nothing to ingest")
    source = IngestSource(format="mds", files=[index, *(s.path for s in shards)], pieces=iter(()))
    source.info["mds.shards"] = str(len(shards))
    source.pieces = _pieces(shards, source, max_sample_bytes)
    return source


def is_mds(src: Path) -> bool:
    """A folder (or its ``index.json``) whose index lists MDS shards."""
    index = src if src.name == INDEX and src.is_file() else src / INDEX
    if not index.is_file():
        return False
    try:
        shards = json.loads(index.read_text()).get("shards")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(shards, list) and bool(shards) and shards[0].get("format") == "mds"


READER = Reader("mds", open_mds, claims=is_mds, bounded=True)
