"""Read LitData ``optimize()`` output (``index.json`` + ``chunk-*.bin``) without LitData or torch.

``index.json`` lists the chunks in order (``chunks``: filename, item count, bytes) and says
how every sample was written (``config``): ``data_format``, one serializer per leaf
(:mod:`.litdata_leaves`), and ``data_spec``, the sample's tree (a torch pytree ``TreeSpec``
as JSON: ``[1, {"type": "builtins.dict", "context": "[\\"x\\", \\"y\\"]", "children_spec":
[...]}]``). Leaves are put back into that tree: dict keys become the sample's field names
(nested dicts stay nested), a tuple or list stays one, as ``.pt`` samples do.

A chunk (``PyTreeLoader``, learnt from ``litdata/streaming/writer.py`` and ``item_loader.py``)::

    u32 n | u32 offsets[n + 1] | items      an item: u32 size per leaf | the leaves' bytes

Offsets are checked (increasing, inside the file, each item within ``--max-sample-bytes``)
before an item is read. Two other layouts share the ``.bin`` name:

* rows of only text and numbers (and lists of them) are kept as an Arrow IPC file at the end
  of the chunk (``... | ipc | u32 len | "LDARW01\\0"``), and LitData reads that: so do we;
* ``compression="zstd"``: by default the items are zstd frames in the chunk (magic
  ``LDFZ01``, a table of frames with their sizes); with ``compression_level="chunk"`` the
  whole file is one zstd frame (``.zstd.bin``) whose size ``index.json`` gives. Frames are
  inflated with pyarrow's zstd to the size written down, never more; a whole-file chunk as
  a stream (:mod:`.inflate`), one item at a time, never past its size.

Refused: encryption, per-sample zstd (``compression_level="sample"``: no size is stored),
loaders other than ``PyTreeLoader`` (tokens, Parquet), pickled fields.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from shardserve.proto.errors import InvalidDataError

from .decode import plain
from .inflate import open_counted
from .litdata_leaves import FIXED, Decode, decoder
from .source import MAX_SAMPLE_BYTES, IngestSource, Piece, Reader, listed_file

INDEX = "index.json"
FOOTER_MAGIC = b"LDARW01\0"
FRAMED_MAGIC = b"LDFZ01\0\0"
_FRAMED_PREFIX = struct.Struct("<8sHHIII")  # magic, version, flags, items, rows/frame, frames
_FRAME = struct.Struct("<IIQII")  # first item, items, file offset, compressed, uncompressed


@dataclass(frozen=True)
class Node:
    """One node of the sample's tree: a leaf (``kind`` "leaf"), a dict, a list or a tuple."""

    kind: str
    keys: tuple[str, ...] = ()
    children: tuple[Node, ...] = ()


@dataclass(frozen=True)
class Leaf:
    """One ``data_format`` entry: its field path (for errors), decoder and fixed size."""

    field: str
    decode: Decode
    arg: str
    size: int | None


@dataclass(frozen=True)
class Chunk:
    path: Path
    items: int
    #: The uncompressed size (``chunk_bytes``), the bound of a whole-file inflate.
    nbytes: int
    #: Whether the whole file is one zstd frame (``compression_level="chunk"``).
    zstd: bool = False


@dataclass(frozen=True)
class Layout:
    """What ``index.json`` says: the chunks in order, the tree, the leaves, the codec."""

    chunks: list[Chunk]
    tree: Node
    leaves: list[Leaf]
    #: ``None``, ``"chunk"`` (whole file) or ``"batch"`` (frames inside the file).
    compression: str | None


_CONTAINERS = {
    "builtins.dict": "dict",
    "collections.OrderedDict": "dict",
    "collections.defaultdict": "dict",
    "builtins.list": "list",
    "builtins.tuple": "tuple",
}


def _node(spec: object, where: str) -> Node:
    if not isinstance(spec, dict):
        raise InvalidDataError(f"{where}: data_spec holds {spec!r}, not a tree node")
    children = tuple(_node(c, where) for c in spec.get("children_spec") or [])
    kind = spec.get("type")
    if kind is None:
        return Node("leaf")
    if kind not in _CONTAINERS:
        raise InvalidDataError(
            f"{where}: samples are {kind}; ingest reads dicts, lists, tuples and single values "
            "(return one of those from the optimize() function)"
        )
    keys: tuple[str, ...] = ()
    if _CONTAINERS[kind] == "dict":
        context = spec.get("context")
        # The dict's keys, as JSON text; a defaultdict's also carry its default factory.
        raw = json.loads(context) if isinstance(context, str) else context
        if isinstance(raw, dict):
            raw = raw.get("dict_keys")
        if not isinstance(raw, list) or len(raw) != len(children):
            raise InvalidDataError(f"{where}: data_spec names {raw!r} as the keys of a dict")
        keys = tuple(str(k) for k in raw)
    return Node(_CONTAINERS[kind], keys, children)


def _paths(node: Node, prefix: str) -> Iterator[str]:
    """The field path of every leaf, in the order LitData flattens them."""
    if node.kind == "leaf":
        yield prefix or "<sample>"
        return
    for i, child in enumerate(node.children):
        name = node.keys[i] if node.kind == "dict" else f"[{i}]"
        yield from _paths(
            child, f"{prefix}.{name}" if prefix and node.kind == "dict" else f"{prefix}{name}"
        )


def _build(node: Node, leaves: Iterator[object]) -> object:
    if node.kind == "leaf":
        return next(leaves)
    values = [_build(c, leaves) for c in node.children]
    if node.kind == "dict":
        return dict(zip(node.keys, values, strict=True))
    return tuple(values) if node.kind == "tuple" else values


def read_layout(src: Path) -> Layout:
    """The layout of the LitData folder ``src``, every serializer checked before any chunk."""
    index = src / INDEX
    try:
        doc = json.loads(index.read_text())
        config, listed = doc["config"], doc["chunks"]
        formats = [str(f) for f in config["data_format"]]
        spec = json.loads(config["data_spec"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidDataError(f"{index}: not a LitData index ({type(e).__name__}: {e})") from None
    if config.get("encryption"):
        raise InvalidDataError(f"{index}: the chunks are encrypted; write the dataset without it")
    loader = config.get("item_loader") or "PyTreeLoader"
    if loader != "PyTreeLoader" or config.get("format") == "mds":
        raise InvalidDataError(
            f"{index}: written by LitData's {loader} ({config.get('format') or 'chunks'}); "
            "ingest reads the default PyTreeLoader chunks of optimize()"
        )
    if not isinstance(spec, list) or len(spec) != 2 or spec[0] != 1:
        raise InvalidDataError(f"{index}: data_spec is not a version 1 pytree spec")
    tree = _node(spec[1], str(index))
    paths = list(_paths(tree, ""))
    if len(paths) != len(formats):
        raise InvalidDataError(
            f"{index}: data_spec has {len(paths)} leaves but data_format {len(formats)}"
        )
    leaves = []
    for path, name in zip(paths, formats, strict=True):
        decode, arg = decoder(name, path, str(index))
        leaves.append(Leaf(path, decode, arg, FIXED.get(name)))
    codec = _codec(config, index)
    chunks = [_listed(src, c, codec, index) for c in listed]
    if not chunks:
        raise InvalidDataError(f"source {src} lists no chunks; nothing to ingest")
    return Layout(chunks, tree, leaves, codec)


def _listed(src: Path, entry: dict[str, object], codec: str | None, index: Path) -> Chunk:
    """One ``chunks`` entry, its file found in ``src``."""
    name = str(entry["filename"])
    file, inflated = name, False
    if codec == "chunk" and not (src / name).is_file() and name.endswith(".zstd.bin"):
        # StreamingDataset over a local folder inflates chunk-N.zstd.bin in place, leaving
        # chunk-N.bin where the index still names the compressed file.
        file, inflated = name[: -len(".zstd.bin")] + ".bin", True
    path = listed_file(src, file, index)
    try:
        return Chunk(
            path,
            int(str(entry["chunk_size"])),
            int(str(entry["chunk_bytes"])),
            codec == "chunk" and not inflated,
        )
    except (KeyError, ValueError) as e:
        raise InvalidDataError(f"{index}: chunk {name} has no {e} count") from None


def _codec(config: dict[str, object], index: Path) -> str | None:
    name = config.get("compression")
    if not name:
        return None
    if not str(name).split(":")[0] == "zstd":
        raise InvalidDataError(f"{index}: compression {name!r} is not read; zstd is")
    level = config.get("compression_level") or "chunk"
    if level not in ("chunk", "batch"):
        raise InvalidDataError(
            f"{index}: compression_level {level!r} stores no sizes to inflate to; write the "
            "dataset with compression_level='batch' (the default) or 'chunk'"
        )
    return str(level)


def _u32s(view: memoryview, offset: int, count: int, path: Path) -> list[int]:
    end = offset + 4 * count
    if end > len(view):
        raise InvalidDataError(f"{path}: the chunk is cut short (its tables end at {end})")
    return list(struct.unpack_from(f"<{count}I", view, offset))


def _check_offsets(offsets: list[int], start: int, end: int, path: Path, limit: int) -> None:
    """Offsets from ``start`` to at most ``end``, never going back, items within ``limit``."""
    if offsets[0] != start or offsets[-1] > end:
        raise InvalidDataError(
            f"{path}: item offsets run {offsets[0]}..{offsets[-1]}, outside {start}..{end}; "
            "the chunk is truncated or corrupt"
        )
    for i in range(len(offsets) - 1):
        size = offsets[i + 1] - offsets[i]
        if size < 0 or offsets[i + 1] > end:
            raise InvalidDataError(
                f"{path}: item {i} runs {offsets[i]}..{offsets[i + 1]}, outside {start}..{end}; "
                "the chunk is corrupt"
            )
        if size > limit:
            raise InvalidDataError(
                f"{path} item {i}: {size} bytes, more than --max-sample-bytes {limit}; raise the "
                "limit if this sample is real"
            )


class _Items:
    """Decodes the items of one layout: leaf sizes, then each leaf by its serializer."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.header = struct.Struct(f"<{len(layout.leaves)}I")
        #: What an error adds to an item's place, per leaf (made once, not per item).
        self.labels = [f" field {leaf.field!r}" for leaf in layout.leaves]

    def sample(self, item: memoryview, where: str) -> object:
        if len(item) < self.header.size:
            raise InvalidDataError(f"{where}: {len(item)} bytes, shorter than its size header")
        sizes = self.header.unpack_from(item)
        if self.header.size + sum(sizes) != len(item):
            raise InvalidDataError(
                f"{where}: its leaves add up to {sum(sizes)} bytes, the item holds "
                f"{len(item) - self.header.size}; the chunk is corrupt"
            )
        values = []
        pos = self.header.size
        for leaf, size, label in zip(self.layout.leaves, sizes, self.labels, strict=True):
            at = where + label
            if leaf.size is not None and size != leaf.size:
                raise InvalidDataError(f"{at}: {size} bytes, its serializer writes {leaf.size}")
            values.append(leaf.decode(item[pos : pos + size], leaf.arg, at))
            pos += size
        return _build(self.layout.tree, iter(values))

    def classic(self, view: memoryview, chunk: Chunk, limit: int) -> Iterator[Piece]:
        (n,) = _u32s(view, 0, 1, chunk.path)
        self._count(n, chunk)
        offsets = _u32s(view, 4, n + 1, chunk.path)
        _check_offsets(offsets, 4 + 4 * (n + 1), len(view), chunk.path, limit)
        for i in range(n):
            where = f"{chunk.path} item {i}"
            yield Piece(where=where, sample=self.sample(view[offsets[i] : offsets[i + 1]], where))

    def framed(self, view: memoryview, chunk: Chunk, limit: int) -> Iterator[Piece]:
        if len(view) < _FRAMED_PREFIX.size:
            raise InvalidDataError(f"{chunk.path}: the framed zstd header is cut short")
        _, version, _, n, _, frames = _FRAMED_PREFIX.unpack_from(view)
        if version != 1:
            raise InvalidDataError(f"{chunk.path}: framed zstd version {version} is not read")
        self._count(n, chunk)
        offsets = _u32s(view, _FRAMED_PREFIX.size, n + 1, chunk.path)
        # Offsets here count uncompressed item bytes from 0: each item is bounded before
        # its frame is inflated, and a frame must inflate to exactly its items.
        _check_offsets(offsets, 0, offsets[-1], chunk.path, limit)
        table = _FRAMED_PREFIX.size + 4 * (n + 1)
        if table + _FRAME.size * frames > len(view):
            raise InvalidDataError(f"{chunk.path}: the frame table is cut short")
        codec = pa.Codec("zstd")
        done = 0
        for f in range(frames):
            first, count, at, packed, size = _FRAME.unpack_from(view, table + _FRAME.size * f)
            if first != done or count < 1 or first + count > n or at + packed > len(view):
                raise InvalidDataError(f"{chunk.path}: frame {f} is outside the chunk or its items")
            base, end = offsets[first], offsets[first + count]
            if size != end - base:
                raise InvalidDataError(
                    f"{chunk.path}: frame {f} says {size} bytes, its items hold {end - base}"
                )
            raw = _inflate(codec, view[at : at + packed], size, f"{chunk.path} frame {f}")
            for i in range(first, first + count):
                where = f"{chunk.path} item {i}"
                item = raw[offsets[i] - base : offsets[i + 1] - base]
                yield Piece(where=where, sample=self.sample(item, where))
            done += count
        if done != n:
            raise InvalidDataError(f"{chunk.path}: its frames hold {done} of {n} items")

    def _count(self, n: int, chunk: Chunk) -> None:
        if n != chunk.items:
            raise InvalidDataError(
                f"{chunk.path}: holds {n} items, {INDEX} says {chunk.items}; the chunk is "
                "truncated or corrupt"
            )


def _inflate(codec: pa.Codec, data: memoryview, size: int, where: str) -> memoryview:
    try:
        out = codec.decompress(data, decompressed_size=size)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise InvalidDataError(f"{where}: not a readable zstd frame ({e})") from None
    if out.size != size:
        raise InvalidDataError(f"{where}: inflated to {out.size} bytes, not {size}")
    return memoryview(out)


def _footer(view: memoryview, chunk: Chunk) -> Iterator[Piece]:
    """Rows kept as an Arrow IPC table at the chunk's end: each a dict, as LitData reads it."""
    (size,) = struct.unpack_from("<I", view, len(view) - 12)
    start = len(view) - 12 - size
    if start < 0:
        raise InvalidDataError(f"{chunk.path}: its Arrow footer is cut short")
    try:
        buf = pa.py_buffer(view[start : start + size])
        is_file = bytes(view[start : start + 6]) == b"ARROW1"
        reader = pa.ipc.open_file(buf) if is_file else pa.ipc.open_stream(buf)
        table = reader.read_all()
    except (pa.ArrowException, OSError, ValueError) as e:
        raise InvalidDataError(f"{chunk.path}: its Arrow footer is not readable ({e})") from None
    if table.num_rows != chunk.items:
        raise InvalidDataError(
            f"{chunk.path}: its Arrow footer holds {table.num_rows} rows, {INDEX} says "
            f"{chunk.items}; the chunk is truncated or corrupt"
        )
    for i, row in enumerate(table.to_pylist()):
        where = f"{chunk.path} item {i}"
        yield Piece(where=where, sample=plain(row, where))


def _chunk(items: _Items, view: memoryview, chunk: Chunk, limit: int) -> Iterator[Piece]:
    if bytes(view[:8]) == FRAMED_MAGIC:
        yield from items.framed(view, chunk, limit)
    elif len(view) >= 12 and bytes(view[-8:]) == FOOTER_MAGIC:
        yield from _footer(view, chunk)
    else:
        yield from items.classic(view, chunk, limit)


def _inflated(items: _Items, chunk: Chunk, limit: int) -> Iterator[Piece]:
    """A whole-file zstd chunk (``compression_level="chunk"``), inflated as a stream: its
    offsets first, then one item at a time (or the Arrow footer after the items), never a
    byte past ``chunk_bytes``, which is bounded by the items it may hold before any is read."""
    # Twice the items' bound: a chunk may hold its rows twice (items and an Arrow copy).
    bound = 2 * chunk.items * limit + 4 * (chunk.items + 2) + (1 << 20)
    if chunk.nbytes > bound:
        raise InvalidDataError(
            f"{chunk.path}: inflates to {chunk.nbytes} bytes for {chunk.items} "
            f"items, more than --max-sample-bytes {limit} allows"
        )
    with open_counted(chunk.path, "zstd", chunk.nbytes, INDEX) as src:
        (n,) = struct.unpack("<I", src.read(4, "its item count"))
        if n != chunk.items:
            raise InvalidDataError(
                f"{chunk.path}: holds {n} items, {INDEX} says {chunk.items} (refused after "
                f"reading {src.produced} of the {chunk.nbytes} bytes {INDEX} lists); the chunk "
                "is truncated or corrupt"
            )
        head = 4 * (n + 2)
        offsets = list(struct.unpack(f"<{n + 1}I", src.read(4 * (n + 1), "its item offsets")))
        _check_offsets(offsets, head, chunk.nbytes, chunk.path, limit)
        if offsets[-1] == chunk.nbytes:
            for i in range(n):
                where = f"{chunk.path} item {i}"
                item = src.read(offsets[i + 1] - offsets[i], f"item {i}")
                yield Piece(where=where, sample=items.sample(item, where))
        else:
            # What follows the items is LitData's Arrow copy of the rows: read from it alone.
            src.skip(offsets[-1] - head, "its items")
            tail = src.read(chunk.nbytes - offsets[-1], "its Arrow footer")
            if len(tail) < 12 or bytes(tail[-8:]) != FOOTER_MAGIC:
                raise InvalidDataError(
                    f"{chunk.path}: {len(tail)} bytes after its items that are not an Arrow "
                    "footer; the chunk is corrupt"
                )
            yield from _footer(tail, chunk)
        src.end()
    yield Piece(where=str(chunk.path), files=1, nbytes=chunk.path.stat().st_size)


def _pieces(layout: Layout, limit: int) -> Iterator[Piece]:
    items = _Items(layout)
    for chunk in layout.chunks:
        if chunk.zstd:
            yield from _inflated(items, chunk, limit)
            continue
        size = chunk.path.stat().st_size
        if size == 0:
            raise InvalidDataError(f"{chunk.path}: empty; the chunk is truncated")
        with chunk.path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                yield from _chunk(items, view, chunk, limit)
            finally:
                view.release()
        yield Piece(where=str(chunk.path), files=1, nbytes=size)


def open_litdata(
    src: Path, threads: int = 1, max_sample_bytes: int = MAX_SAMPLE_BYTES
) -> IngestSource:
    """A source over the LitData folder ``src`` (see the module docstring)."""
    if src.is_file():
        src = src.parent
    layout = read_layout(src)
    source = IngestSource(format="litdata", files=[c.path for c in layout.chunks], pieces=iter(()))
    source.info["litdata.chunks"] = str(len(layout.chunks))
    source.pieces = _pieces(layout, max_sample_bytes)
    return source


def is_litdata(src: Path) -> bool:
    """A LitData folder: ``index.json`` with ``chunks`` and ``config`` (MosaicML's MDS
    ``index.json`` has ``shards`` instead, and is not claimed)."""
    index = src / INDEX if src.is_dir() else src
    if index.name != INDEX or not index.is_file():
        return False
    try:
        doc = json.loads(index.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "chunks" in doc and "config" in doc


READER = Reader("litdata", open_litdata, claims=is_litdata, bounded=True)
