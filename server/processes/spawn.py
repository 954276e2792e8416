"""Starting one streaming process and what the main process keeps of it.

A process is a fresh interpreter (``python -m shardserve.server.processes.child``) given its
:class:`~.config.ChildConfig` as JSON on stdin, so nothing crosses pickled; the main process
binds its end of the link first and watches the process through a pidfd.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import zmq

from shardserve.proto.processes import Family

from ..runtime.logs import log_event
from .config import ChildConfig
from .link import Link

log = logging.getLogger("shardserve.processes")

#: How long a killed process may take to be reaped before that is logged and left.
REAP_S = 10.0


@dataclass(eq=False)
class Child:
    """One running streaming process, as the main process's thread tracks it."""

    index: int
    proc: subprocess.Popen[bytes]
    link: Link
    #: Readable once the process exited (``os.pidfd_open``).
    pidfd: int
    #: Set by its Ready: its data endpoints are bound and it reads its link.
    ready: threading.Event = field(default_factory=threading.Event)
    #: Its metric families, as last reported.
    families: list[Family] = field(default_factory=list)
    #: ``(job, rank, stream)`` of every stream it reported open.
    open: set[tuple[str, int, int]] = field(default_factory=set)
    last_report: float = field(default_factory=time.monotonic)
    endpoints: list[str] = field(default_factory=list)
    spawned: float = field(default_factory=time.monotonic)


def spawn(ctx: zmq.Context, config: ChildConfig) -> Child:
    """Bind ``config.link`` and start the process; on any failure nothing is left open."""
    link = Link(ctx, config.link, bind=True)
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardserve.server.processes.child"],
            stdin=subprocess.PIPE,
            close_fds=True,
        )
        assert proc.stdin is not None
        proc.stdin.write(config.model_dump_json().encode())
        proc.stdin.close()
        pidfd = os.pidfd_open(proc.pid)
    except BaseException:
        link.close()
        if proc is not None:
            proc.kill()
            reap(proc)
        raise
    log_event(log, "processes.started", process=config.index, pid=proc.pid)
    return Child(config.index, proc, link, pidfd)


def reap(proc: subprocess.Popen[bytes]) -> int | None:
    """Wait for a killed process; its exit code, or None (logged, naming it) when it is
    not gone within :data:`REAP_S`."""
    try:
        return proc.wait(REAP_S)
    except subprocess.TimeoutExpired:
        log_event(log, "processes.not_reaped", level=logging.ERROR, pid=proc.pid, waited_s=REAP_S)
        return None


def close_child(c: Child) -> None:
    """Close the main process's end of ``c``'s link and its pidfd."""
    c.link.close()
    with contextlib.suppress(OSError):
        os.close(c.pidfd)
