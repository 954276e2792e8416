"""``shardserve ingest --engine ray``: Ray Data tasks write the shards, the driver publishes.

::

    driver: list + sort the source files (as local ingest) -> contiguous groups of files
    Ray Data: one task per group: open each file with the same readers, write whole shards
              with the same ShardWriter into <root>/.tmp-<name>-<rand>/parts/part-NNNNN/
    driver: check every part has the same fields, renumber the shards in group order into
            <tmp>/shards/, write manifest.json, publish by rename (layout.publish)

Samples keep the local ingest's order (groups are contiguous runs of the sorted files and
parts are concatenated in group order), so the dataset is the same sample by sample; only
where shard boundaries fall differs. Any failed task fails the ingest and nothing is
published; the temp folder is removed.

Ray runs locally (``ray.init`` with ``num_cpus`` or the machine's cores) unless
``RAY_ADDRESS`` names a cluster, which Ray itself reads; on a cluster the store folder must be
a filesystem every node sees (or give a ``s3://`` store: the dataset is then uploaded by the
driver). Ray is an optional extra: ``pip install 'shardserve[ray]'``.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypedDict

from tqdm import tqdm

from shardserve.proto.errors import InvalidDataError
from shardserve.proto.manifest import FieldSpec, Manifest, ShardInfo, validate_dataset_name

from .. import layout
from ..remote.publish import RemotePublisher, new_shard_prefix
from ..write.writer import ShardWriter
from .registry import open_ingest_source
from .run import IngestSummary

if TYPE_CHECKING:
    from ..remote.stores import RemoteStore

#: One task's row as Ray Data hands it over (built by :func:`ingest_ray`); open because Ray
#: converts the row on the way (a list may arrive as an array), so no narrower type holds.
PartRow = dict[str, Any]


class PartDone(TypedDict):
    """What a task returns: its part number, the part's manifest (JSON), bytes read."""

    part: int
    manifest: str
    bytes: int


def _ray() -> ModuleType:
    try:
        import ray
        import ray.data
    except ImportError:
        raise InvalidDataError(
            "--engine ray needs Ray Data: pip install 'shardserve[ray]'"
        ) from None
    return ray


def groups_of(files: list[Path], sizes: list[int], tasks: int) -> list[list[Path]]:
    """Split sorted ``files`` into at most ``tasks`` contiguous runs of similar byte size."""
    total = sum(sizes)
    per = max(1, -(-total // max(tasks, 1)))
    out: list[list[Path]] = [[]]
    acc = 0
    for f, n in zip(files, sizes, strict=True):
        if out[-1] and acc + n > per:
            out.append([])
            acc = 0
        out[-1].append(f)
        acc += n
    return out


def write_part(row: PartRow) -> PartDone:
    """A Ray task: ingest ``row["files"]`` into the part dataset ``row["name"]``.

    For a local store the part is published under ``row["root"]``; for a remote one
    (``row["remote"]``) it is written to a task-local temp folder and its shards are uploaded
    to the store under ``row["prefix"]``. Returns the part's manifest (JSON).
    """
    remote = row.get("remote")
    with tempfile.TemporaryDirectory(prefix="shardserve-part-") as tmp:
        root, name = Path(row["root"] if remote is None else tmp), row["name"]
        read = 0
        with ShardWriter(
            root, name, shard_bytes=int(row["shard_bytes"]), variable=set(row["variable"])
        ) as writer:
            for f in row["files"]:
                source = open_ingest_source(Path(f), row["format"], threads=1)
                for piece in source.pieces:
                    if piece.sample is not None:
                        writer.add(piece.sample, where=piece.where)
                    elif piece.columns is not None:
                        writer.add_batch(piece.columns, where=piece.where)
                    read += piece.nbytes
            if writer.num_samples == 0:
                raise InvalidDataError(f"files {row['files'][0]}... hold no samples")
        manifest = writer.manifest
        assert manifest is not None
        if remote is not None:
            from ..remote.object_fs import StoreOptions
            from ..remote.stores import RemoteStore

            store = RemoteStore(
                remote["uri"], StoreOptions(endpoint=remote["endpoint"], region=remote["region"])
            )
            shards = []
            for info in manifest.shards:
                rel = f"{row['prefix']}/{name}-{Path(info.path).name}"
                RemotePublisher(store).put_file(root / name / info.path, f"{row['dataset']}/{rel}")
                shards.append(info.model_copy(update={"path": rel}))
            manifest = manifest.model_copy(update={"shards": tuple(shards)})
    return {"part": int(row["part"]), "manifest": manifest.model_dump_json(), "bytes": read}


def _merge_fields(parts: list[Manifest]) -> tuple[FieldSpec, ...]:
    """The fields of all parts: equal, except that a dimension variable in one is in all."""
    first = parts[0].fields
    merged = []
    for i, spec in enumerate(first):
        shape = list(spec.shape)
        for m in parts[1:]:
            other = m.fields[i] if i < len(m.fields) else None
            if (
                other is None
                or (other.name, other.dtype, other.kind) != (spec.name, spec.dtype, spec.kind)
                or len(other.shape) != len(shape)
            ):
                raise InvalidDataError(
                    f"source files disagree on field {spec.name!r}: {spec} in one part, "
                    f"{other} in another"
                )
            shape = [-1 if a != b else a for a, b in zip(shape, other.shape, strict=True)]
        merged.append(
            FieldSpec(name=spec.name, dtype=spec.dtype, shape=tuple(shape), encoding=spec.encoding)
        )
    if any(len(m.fields) != len(first) for m in parts):
        raise InvalidDataError("source files disagree on the set of fields")
    return tuple(merged)


def ingest_ray(
    src: str | Path,
    store: str | Path,
    name: str,
    *,
    fmt: str = "auto",
    shard_bytes: int = 256 << 20,
    overwrite: bool = False,
    variable: Collection[str] = (),
    progress: bool = True,
    num_cpus: int | None = None,
    remote: RemoteStore | None = None,
) -> IngestSummary:
    """Ingest ``src`` into dataset ``name`` with Ray Data tasks: of the folder ``store``, or,
    given ``remote`` (a :class:`~..remote.RemoteStore`), of that store, each task uploading
    its own shards and the driver the manifest last (``store`` is then unused)."""
    validate_dataset_name(name)
    ray = _ray()
    src_path, root = Path(src), Path(store)
    started = time.perf_counter()
    source = open_ingest_source(src_path, fmt, threads=1)
    _check_absent(root, name, overwrite, remote)
    files, fmt = source.files, source.format
    sizes = [f.stat().st_size for f in files]
    variable = set(variable) | source.variable
    cpus = _start_ray(ray, num_cpus)
    runs = _runs(src_path, files, sizes, fmt, 2 * cpus)
    temp, owned = _temp_dir(root, name, remote)
    parts_root = temp / "parts"
    prefix = new_shard_prefix()
    try:
        rows = _part_rows(
            runs, parts_root, shard_bytes, variable, remote, fmt=fmt, dataset=name, prefix=prefix
        )
        done = _write_parts(ray, rows, f"ingest {name} (ray, {cpus} CPUs)", progress, remote)
        parts = [Manifest.model_validate_json(d["manifest"]) for d in done]
        fields = _merge_fields(parts)  # before any shard moves: a mismatch moves nothing
        shards = _gather_shards(parts, parts_root, temp, remote)
        manifest = _manifest(name, parts, fields, shards, src_path, fmt, len(files))
        _publish(manifest, temp, root, overwrite, remote)
    except BaseException:
        if remote is not None:  # shards some tasks uploaded: nothing references them
            RemotePublisher(remote).delete_prefix(f"{name}/{prefix}")
        raise
    finally:
        shutil.rmtree(temp, ignore_errors=True)
        if owned is not None:
            owned.release()
    read = sum(d["bytes"] for d in done)
    return IngestSummary(manifest, len(files), read, time.perf_counter() - started)


def _check_absent(root: Path, name: str, overwrite: bool, remote: RemoteStore | None) -> None:
    """Refuse to write over dataset ``name`` without ``overwrite``."""
    if remote is not None:
        RemotePublisher(remote).check_absent(name, overwrite)
    elif (root / name).exists() and not overwrite:
        raise InvalidDataError(
            f"dataset {name!r} already exists in {root}; pass --overwrite to replace it"
        )


def _start_ray(ray: ModuleType, num_cpus: int | None) -> int:
    """Join (or start) Ray; the cluster's CPUs."""
    if not ray.is_initialized():
        # RAY_ADDRESS (read by Ray) joins a cluster; otherwise a local instance is started.
        ray.init(
            num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False
        )
    cpus = int(ray.cluster_resources().get("CPU", 1))
    ray.data.DataContext.get_current().enable_progress_bars = False  # ours is below
    return cpus


def _temp_dir(
    root: Path, name: str, remote: RemoteStore | None
) -> tuple[Path, layout.OwnedDir | None]:
    """Where the tasks write their parts: a temp folder of the store, owned (locked) for the
    whole write so another ingest's sweep never takes it for stale; for a remote store, a
    local folder nothing is written to (tasks upload their shards)."""
    if remote is not None:
        return Path(tempfile.mkdtemp(prefix="shardserve-ray-")), None
    layout.clean_stale(root)
    owned = layout.new_temp_dir(root, name)
    return owned.path, owned


def _runs(src: Path, files: list[Path], sizes: list[int], fmt: str, n: int) -> list[list[Path]]:
    """``files`` (of ``sizes`` bytes) in at most ``n`` contiguous runs, one task's each;
    ``[[src]]`` for a folder of .npy files, which is one table (a file per field) and cannot
    be split by file."""
    if fmt == "npz" and any(f.suffix.lower() == ".npy" for f in files):
        return [[src]]
    return groups_of(files, sizes, n)


def _part_rows(
    runs: list[list[Path]],
    parts_root: Path,
    shard_bytes: int,
    variable: Collection[str],
    remote: RemoteStore | None,
    *,
    fmt: str,
    dataset: str,
    prefix: str,
) -> list[PartRow]:
    """One row per run: what its task reads and where it writes its part."""
    return [
        {
            "part": i,
            "name": f"part-{i:05d}",
            "root": str(parts_root),
            "files": [str(f) for f in run],
            "format": fmt,
            "shard_bytes": shard_bytes,
            "variable": sorted(variable),
            "remote": remote.reopen_args() if remote is not None else None,
            "dataset": dataset,
            "prefix": prefix,
        }
        for i, run in enumerate(runs)
    ]


def _write_parts(
    ray: ModuleType, rows: list[PartRow], desc: str, progress: bool, remote: RemoteStore | None
) -> list[PartDone]:
    """Run :func:`write_part` on every row as a Ray task, ticking a bar; what they returned,
    in part order. A task's error is raised as its own message (secrets scrubbed)."""
    ds = ray.data.from_items(rows, override_num_blocks=len(rows))
    done: list[PartDone] = []
    with tqdm(
        total=len(rows), unit="part", desc=desc, disable=not progress, file=sys.stderr
    ) as bar:
        try:
            for out in ds.map(write_part, num_cpus=1).iter_rows():
                done.append(out)
                bar.update(1)
        except Exception as e:  # a task's error arrives wrapped by Ray: keep its message
            msg = _root_cause(e)
            if remote is not None:
                msg = remote.scrub(msg)
            raise InvalidDataError(f"a Ray ingest task failed; nothing published: {msg}") from None
    done.sort(key=lambda d: d["part"])
    return done


def _gather_shards(
    parts: list[Manifest], parts_root: Path, temp: Path, remote: RemoteStore | None
) -> list[ShardInfo]:
    """Every part's shards in part order: for a local store moved from the parts' folders to
    the dataset's, renumbered (the parts' folders are removed then); a remote store's are
    already uploaded by their task under their final names."""
    shards: list[ShardInfo] = []
    for m in parts:
        for info in m.shards:
            if remote is not None:
                shards.append(info)
                continue
            rel = layout.shard_name(len(shards))
            os.rename(parts_root / m.name / info.path, temp / rel)
            shards.append(info.model_copy(update={"path": rel}))
    shutil.rmtree(parts_root, ignore_errors=True)
    return shards


def _manifest(
    name: str,
    parts: list[Manifest],
    fields: tuple[FieldSpec, ...],
    shards: list[ShardInfo],
    src: Path,
    fmt: str,
    files: int,
) -> Manifest:
    """The dataset's manifest: the parts' samples, their ``fields``, ``shards`` in order."""
    return Manifest(
        name=name,
        num_samples=sum(m.num_samples for m in parts),
        fields=fields,
        shards=tuple(shards),
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        source={
            "path": str(src.resolve()),
            "format": fmt,
            "files": str(files),
            "engine": "ray",
        },
    )


def _publish(
    manifest: Manifest, temp: Path, root: Path, overwrite: bool, remote: RemoteStore | None
) -> None:
    """Publish the dataset: its manifest uploaded last, or the temp folder renamed into place."""
    if remote is not None:
        RemotePublisher(remote).publish_manifest(manifest, overwrite=overwrite)
    else:
        layout.write_manifest(temp, manifest)
        layout.publish(temp, root, manifest.name, overwrite=overwrite)


def _root_cause(e: BaseException) -> str:
    """The task's own ``Error: message`` line out of a Ray-wrapped task error."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    for line in text.splitlines():
        m = re.match(r"^(?:[\w]+\.)*(\w*(?:Error|Exception)): (.+)$", line.strip())
        if m and "RayTaskError" not in m.group(1):
            return f"{m.group(1)}: {m.group(2)}"
    lines = text.strip().splitlines()
    return lines[0] if lines else type(e).__name__
