"""The job journal: ``<state_dir>/jobs.jsonl``, the records in it, and its one writer.

One JSON object per line, appended and fsync'd, replayed at start::

    {"op": "create", "id": "…", "spec": {…}, "num_samples": 50000}
    {"op": "epoch",  "id": "…", "epoch": 3, "seed": 7}
    {"op": "delete", "id": "…"}
    {"op": "mixture", "id": "…", "at_step": 1200, "weights": [0.5, 0.5]}
    {"op": "quarantine", "dataset": "web", "ids": [7, 9], "reason": "…", "at": {"<job id>": 1200}}

A mixture job's create record carries its sources' sizes (``source_sizes``): the pinned
versions never change, so its plans need no store at replay.

Every line is validated as one of :data:`Record` before it is used; a line that is not (a torn
last line after a crash, a hand edit that made an id a number) is skipped with one log line
naming the file, the line and what is wrong, never turned into a job that breaks a request.

**One writer.** :meth:`EpochJournal.acquire` takes an exclusive ``fcntl.flock`` on
``<state_dir>/jobs.lock`` for the life of the server: a second server pointed at the same
state dir (two servers on one store) gets :class:`JournalLocked` at start, naming the holder's
pid and the way out (``--state-dir``), instead of interleaving lines or taking over the first
server's jobs; the service then keeps its jobs in memory only and says so. The kernel drops
the lock when its holder dies, so a ``kill -9`` never leaves a stale one behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from shardserve.proto.jobs import JobSpec

from ..runtime.logs import log_event

log = logging.getLogger("shardserve.journal")

#: A job id as :func:`shardserve.proto.jobs.job_id` makes them (and a little slack).
JobIdStr = Annotated[str, Field(strict=True, min_length=1, max_length=64, pattern=r"^[0-9a-f]+$")]


class _Rec(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class CreateRecord(_Rec):
    op: Literal["create"]
    id: JobIdStr
    spec: JobSpec
    num_samples: int = Field(strict=True, ge=0)
    source_sizes: tuple[int, ...] | None = None


class EpochRecord(_Rec):
    op: Literal["epoch"]
    id: JobIdStr
    epoch: int = Field(strict=True, ge=0, lt=1 << 31)
    seed: int = Field(strict=True, ge=0, lt=1 << 63)


class DeleteRecord(_Rec):
    op: Literal["delete"]
    id: JobIdStr


class MixtureRecord(_Rec):
    """A mixture job's weights from a global step on."""

    op: Literal["mixture"]
    id: JobIdStr
    at_step: int = Field(strict=True, ge=0, lt=1 << 62)
    weights: tuple[float, ...] = Field(min_length=1)


class QuarantineRecord(_Rec):
    """Samples of a dataset quarantined, from a step per job reading it (0 for jobs made later)."""

    op: Literal["quarantine"]
    dataset: str = Field(min_length=1, max_length=128)
    ids: tuple[int, ...] = Field(min_length=1)
    reason: str
    at: dict[JobIdStr, int]


AnyRecord = CreateRecord | EpochRecord | DeleteRecord | MixtureRecord | QuarantineRecord
Record = Annotated[AnyRecord, Field(discriminator="op")]
_RECORD: TypeAdapter[AnyRecord] = TypeAdapter(Record)


class JournalLocked(RuntimeError):
    """Another live server already writes this journal."""


class EpochJournal:
    """Append-only JSON-lines file of job changes; durable once :meth:`append` returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.stem + ".lock")
        self._lock_fd: int | None = None

    # -- the one-writer lock ------------------------------------------------------------

    def acquire(self) -> None:
        """Become the journal's only writer, or raise :class:`JournalLocked` at once."""
        if self._lock_fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise JournalLocked(
                f"another shardserve server (pid {holder}) owns the job journal {self.path}: "
                "two servers must not share one; give this one its own --state-dir "
                "(SHARDSERVE_STATE_DIR), or stop the other"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    # -- records ------------------------------------------------------------------------

    def replay(self) -> list[AnyRecord]:
        """Every valid record in order; each invalid line is skipped with one log line."""
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return []
        records: list[AnyRecord] = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(_RECORD.validate_json(line))
            except ValidationError as e:
                log_event(
                    log,
                    "journal.skipped_line",
                    level=logging.WARNING,
                    path=str(self.path),
                    line=lineno,
                    reason=_reason(e),
                )
        return records

    def append(self, record: Mapping[str, object]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def rewrite(self, records: Sequence[Mapping[str, object]]) -> None:
        """Replace the journal with ``records`` atomically (tmp file, fsync, rename)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def _reason(e: ValidationError) -> str:
    """The first problem of a line, short enough for one log line."""
    errs = e.errors(include_url=False)
    if not errs:
        return str(e)
    first = errs[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "line"
    more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid')}{more}"
