"""Drive one ingest: open the source, stream its pieces into a ``ShardWriter``, report progress.

The progress bar (stderr) counts source bytes (so it shows MB/s) with files and samples
beside it; the result is an :class:`IngestSummary` for the one-line report.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from tqdm import tqdm

from shardserve.proto.errors import InvalidDataError
from shardserve.proto.manifest import Manifest, validate_dataset_name

from ..write.writer import ShardWriter
from .mapping import mapped, resolve_map
from .registry import READERS, SUFFIXES, claimed, open_ingest_source
from .source import MAX_SAMPLE_BYTES, IngestSource, Piece
from .splits import Split, find_splits, pick, split_dataset_name

if TYPE_CHECKING:
    # typing.Unpack is 3.11+; only the type checker reads it
    from typing_extensions import Unpack


#: Left-out files a summary names (the rest are counted).
LEFT_OUT_SHOWN = 5


@dataclass(frozen=True)
class IngestSummary:
    """What one ingest produced."""

    manifest: Manifest
    files: int
    source_bytes: int
    seconds: float
    #: What the source held that is not samples, and what became of it (name -> note).
    metadata: Mapping[str, str] = field(default_factory=dict)
    #: The split of the source this dataset holds (``None``: the source is not split).
    split: str | None = None
    #: Files of the source folder that are not of its format, and so were not read.
    left_out: tuple[str, ...] = ()

    def line(self) -> str:
        m = self.manifest
        mb = m.total_bytes / 1e6
        rate = self.source_bytes / 1e6 / max(self.seconds, 1e-9)
        split = f" (split {self.split})" if self.split else ""
        return (
            f"ingested {m.name}{split}: {m.num_samples} samples, {len(m.shards)} shards, "
            f"{mb:.1f} MB, {self.seconds:.1f} s ({self.files} files, {rate:.1f} MB/s read)"
            f"{self.choices()}"
        )

    def choices(self) -> str:
        """What ingest decided on its own: variable shapes found, fields found missing."""
        var = [f"{f.name} {list(f.shape)}" for f in self.manifest.fields if f.kind == "variable"]
        null = [f.name for f in self.manifest.fields if f.nullable]
        out = ""
        if var:
            out += f"; variable: {', '.join(var)}"
        if null:
            out += f"; may be missing (masked): {', '.join(null)}"
        out += _value_format_note(self.manifest)
        if self.metadata:
            notes = ", ".join(f"{k} ({v})" for k, v in self.metadata.items())
            out += f"; not samples: {notes}"
        if self.left_out:
            n = len(self.left_out)
            shown = ", ".join(self.left_out[:LEFT_OUT_SHOWN])
            more = f" and {n - LEFT_OUT_SHOWN} more" if n > LEFT_OUT_SHOWN else ""
            fmt = self.manifest.source.get("format", "")
            out += (
                f"; left out {n} file(s) that are not {fmt} files: {shown}{more} (not read; "
                "give data files their format's suffix, or move them out)"
            )
        return out


def _value_format_note(m: Manifest) -> str:
    """What ``--value-format auto`` decided for an LMDB environment's values, with the flag."""
    how = m.source.get("value_format")
    if how == "msgpack (detected)":
        return "; values read as msgpack maps (detected; --value-format raw keeps the bytes)"
    raw = [f.name for f in m.fields if f.name == "value" and f.dtype == "binary"]
    if how == "auto" and raw:
        return (
            "; values kept as bytes (field value): if they are msgpack, JSON, .pt or .npy, "
            "give --value-format msgpack|json|pt|npy"
        )
    return ""


@dataclass(frozen=True)
class IngestReport:
    """What one ``shardserve ingest`` produced: one dataset, or one per split."""

    summaries: tuple[IngestSummary, ...]
    #: The splits the source has, when it is split (``()``: it is not).
    splits: tuple[str, ...] = ()

    def line(self) -> str:
        lines = [s.line() for s in self.summaries]
        if len(self.summaries) > 1:
            names = ", ".join(s.manifest.name for s in self.summaries)
            lines.insert(
                0,
                f"source has splits {', '.join(self.splits)}: each ingested as its own dataset "
                f"({names}); pick one with --split",
            )
        return "\n".join(lines)


def ingest(
    src: str | Path,
    store: str | Path,
    name: str,
    *,
    fmt: str = "auto",
    shard_bytes: int = 256 << 20,
    overwrite: bool = False,
    variable: Collection[str] = (),
    threads: int = 2,
    progress: bool = True,
    stacked: bool = False,
    map_fn: str | None = None,
    workers: int = 0,
    split: str | None = None,
    max_sample_bytes: int = MAX_SAMPLE_BYTES,
    value_format: str = "auto",
) -> IngestSummary:
    """Ingest ``src`` into dataset ``name`` of ``store``; nothing is published on any error.

    Shapes that vary between samples are found (the field becomes variable; ``variable``
    declares one up front), and fields missing in some samples become nullable; the summary
    line says which. ``map_fn`` (``"module:function"``) runs over each source sample first,
    in ``workers`` processes (0: in this one). No sample may be larger than
    ``max_sample_bytes`` (checked before reading where the source says sizes first). A source laid out as splits (:mod:`.splits`)
    needs ``split`` (one of them); :func:`ingest_all` ingests every split.

    >>> ingest("hf_dd", "/data/store", "mnist-train", split="train")  # doctest: +SKIP
    """
    return _Ingest(
        src=Path(src),
        store=store,
        name=name,
        fmt=fmt,
        shard_bytes=shard_bytes,
        overwrite=overwrite,
        variable=variable,
        threads=threads,
        progress=progress,
        stacked=stacked,
        map_fn=map_fn,
        workers=workers,
        split=split,
        max_sample_bytes=max_sample_bytes,
        value_format=value_format,
    ).run()


@dataclass(frozen=True, kw_only=True)
class _Ingest:
    """One :func:`ingest`: its arguments (see there), then its steps: choose the folder (a
    split of the source), open the source, write its samples (through ``map_fn``) into a new
    dataset and publish it."""

    src: Path
    store: str | Path
    name: str
    fmt: str
    shard_bytes: int
    overwrite: bool
    variable: Collection[str]
    threads: int
    progress: bool
    stacked: bool
    map_fn: str | None
    workers: int
    split: str | None
    max_sample_bytes: int
    value_format: str

    def run(self) -> IngestSummary:
        """Ingest; nothing is published on any error."""
        validate_dataset_name(self.name)
        src, only = _chosen_split(self.src, self.fmt, self.split)
        started = time.perf_counter()
        source = open_ingest_source(
            src,
            self.fmt,
            threads=self.threads,
            stacked=self.stacked,
            only=only,
            max_sample_bytes=self.max_sample_bytes,
            value_format=self.value_format,
        )
        if self.workers < 0:
            raise InvalidDataError(f"--workers must be 0 or more, got {self.workers}")
        fn = resolve_map(self.map_fn) if self.map_fn else None
        skipped = tuple(p.relative_to(src).as_posix() for p in source.left_out)
        with (
            _progress_bar(source.total_bytes, self.name, self.progress) as bar,
            self._writer(source, src, skipped) as writer,
            mapped(source.pieces, fn, self.map_fn or "", self.workers) as pieces,
        ):
            files, read = self._fill(writer, pieces, source, fn is not None, bar, src)
        manifest = writer.manifest
        if manifest is None:  # unreachable: a clean exit of the with-block publishes
            raise InvalidDataError(f"ingest of {self.name!r} finished without a manifest")
        took = time.perf_counter() - started
        meta = dict(source.metadata)
        return IngestSummary(manifest, files, read, took, meta, self.split, skipped)

    def _writer(self, source: IngestSource, src: Path, skipped: Sequence[str]) -> ShardWriter:
        """The writer of the new dataset, its manifest saying where its samples came from."""
        return ShardWriter(
            self.store,
            self.name,
            shard_bytes=self.shard_bytes,
            overwrite=self.overwrite,
            source=_source_info(source, src, skipped),
            variable=set(self.variable) | source.variable,
            max_sample_bytes=self.max_sample_bytes,
        )

    def _fill(
        self,
        writer: ShardWriter,
        pieces: Iterable[Piece],
        source: IngestSource,
        is_mapped: bool,
        bar: tqdm,
        src: Path,
    ) -> tuple[int, int]:
        """Write every piece (``is_mapped``: made by a map) and what reading found out about
        the source; files finished and bytes read. A source of no samples is refused."""
        # A map returns samples of its own making: their tree is the writer's to find.
        writer.structure = None if is_mapped else source.structure
        writer.encodings = {} if is_mapped else source.text  # filled as pieces are read
        files, read = _write(pieces, writer, bar, len(source.files), self.progress)
        if writer.num_samples == 0:
            raise InvalidDataError(f"source {src} holds no samples; nothing to ingest")
        # Found while reading (metadata keys, class names): kept in the manifest.
        writer.source.update({str(k): str(v) for k, v in source.info.items()})
        if self.split is not None:
            writer.source["split"] = self.split
        return files, read


def _chosen_split(src: Path, fmt: str, split: str | None) -> tuple[Path, tuple[Path, ...] | None]:
    """The folder to ingest and its files (``None``: all): ``src`` itself, or its split
    ``split``; a source with splits needs ``split`` named."""
    if not src.exists():
        raise InvalidDataError(f"source {src} does not exist")
    splits = _splits(src, fmt)
    if not splits and split is None:
        return src, None
    if split is None:
        raise InvalidDataError(
            f"source {src} has splits {', '.join(s.name for s in splits)}; ingest one "
            "with --split NAME, or all of them (each its own dataset) without --split"
        )
    chosen = pick(splits, split, src)
    return chosen.path, chosen.files


def _source_info(source: IngestSource, src: Path, skipped: Sequence[str]) -> dict[str, str]:
    """What the manifest records of the source at the start: its path, format, file count,
    files left out and what it says of itself."""
    return {
        "path": str(src.resolve()),
        "format": source.format,
        "files": str(len(source.files)),
        **({"left_out": str(len(skipped))} if skipped else {}),
        **source.info,
    }


def _progress_bar(total: int | None, name: str, progress: bool) -> tqdm:
    """The bar of the bytes ingested, on stderr (``progress=False``: none shown)."""
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"ingest {name}",
        disable=not progress,
        file=sys.stderr,
        mininterval=0.5,
    )


def _splits(src: Path, fmt: str) -> list[Split]:
    """The splits of ``src``, unless a folder format claims it whole."""
    if fmt not in ("auto", *(r.name for r in READERS if r.suffixes)) or claimed(src):
        return []
    return find_splits(src, SUFFIXES)


class IngestOptions(TypedDict, total=False):
    """:func:`ingest`'s options that :func:`ingest_all` passes on (see there)."""

    fmt: str
    shard_bytes: int
    overwrite: bool
    variable: Collection[str]
    threads: int
    progress: bool
    stacked: bool
    map_fn: str | None
    workers: int
    max_sample_bytes: int
    value_format: str


def ingest_all(
    src: str | Path,
    store: str | Path,
    name: str,
    *,
    split: str | None = None,
    **kw: Unpack[IngestOptions],
) -> IngestReport:
    """:func:`ingest`, or, for a source laid out as splits and no ``split`` chosen, one
    dataset per split named ``NAME-split`` (:func:`.splits.split_dataset_name`).

    Each split is published when it is complete; if one fails, the error says which were
    published before it."""
    validate_dataset_name(name)
    src_path = Path(src)
    splits = _splits(src_path, kw.get("fmt", "auto")) if src_path.exists() else []
    if split is not None or not splits:
        return IngestReport((ingest(src_path, store, name, split=split, **kw),))
    done: list[IngestSummary] = []
    for s in splits:
        target = validate_dataset_name(split_dataset_name(name, s.name))
        try:
            done.append(ingest(src_path, store, target, split=s.name, **kw))
        except InvalidDataError as e:
            before = ", ".join(d.manifest.name for d in done)
            raise InvalidDataError(
                f"split {s.name!r} -> {target}: {e}"
                + (f" (already published: {before})" if before else "")
            ) from None
    return IngestReport(tuple(done), tuple(s.name for s in splits))


def _write(
    pieces: Iterable[Piece], writer: ShardWriter, bar: tqdm, num_files: int, progress: bool
) -> tuple[int, int]:
    """Hand every piece to ``writer``, ticking ``bar``; files finished and bytes read."""
    files = read = 0
    for i, piece in enumerate(pieces):
        if piece.sample is not None:
            writer.add(piece.sample, where=piece.where)
        elif piece.columns is not None:
            writer.add_batch(piece.columns, where=piece.where)
        files += piece.files
        read += piece.nbytes
        bar.update(piece.nbytes)
        if progress and i % 256 == 0:
            bar.set_postfix_str(
                f"{files}/{num_files} files, {writer.num_samples} samples", refresh=False
            )
    if progress:  # the real final counts, not those of the last 256th piece
        bar.set_postfix_str(
            f"{files}/{num_files} files, {writer.num_samples} samples", refresh=True
        )
    return files, read
