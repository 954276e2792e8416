"""A streaming process: the data plane of a server without its control plane.

Started by the main process (``python -m shardserve.server.processes.child``, its
:class:`ChildConfig` as JSON on stdin). It maps the same store, runs its own streamer,
assembly lanes, plan cache and transform workers, and serves only the streams the main
process placed here (:class:`~.replica.JobReplica`). Every ``REPORT_S`` it reports what its
streams did (:class:`~.feed.BoardFeed`), and once a second its metric families too; it exits
when told to stop, or when the main process is gone.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import zmq

from shardserve.proto.errors import ErrorCode
from shardserve.proto.processes import (
    Ack,
    AdmitStream,
    EndJob,
    Family,
    LinkMessage,
    Ready,
    Stop,
    UpdateJob,
    stream_ids_of,
)

from ..runtime.logs import configure_logging, log_event
from ..settings import Settings
from .config import ChildConfig
from .counters import families_of
from .link import Link
from .plane import ChildPlane

log = logging.getLogger("shardserve.processes")

#: Seconds between two reports to the main process.
REPORT_S = 0.25
#: Report periods between two reports of the totals (and of an idle process).
TOTALS_EVERY = 4


def serve_child(config: ChildConfig, settings: Settings) -> int:
    """Run one streaming process of ``settings`` until told to stop; the exit status."""
    plane = ChildPlane(settings, config.index, config.processes, stream_ids_of(config.index))
    ctx = zmq.Context()
    link = Link(ctx, config.link, bind=False)
    try:
        endpoints = plane.start(config.data_endpoints)
        link.send(Ready(pid=os.getpid(), data_endpoints=endpoints))
        _loop(link, plane, os.getppid())
    finally:
        plane.stop()
        link.close()
        ctx.term()
    return 0


def _loop(link: Link, plane: ChildPlane, parent: int) -> None:
    poller = zmq.Poller()
    poller.register(link.sock, zmq.POLLIN)
    next_report, ticks = time.monotonic() + REPORT_S, 0
    sent: list[Family] = []
    while os.getppid() == parent:  # an orphan stops: nobody places or reads its streams
        wait = max(0.0, next_report - time.monotonic())
        if poller.poll(int(wait * 1000)):
            while (msg := link.recv()) is not None:
                if not _handle(link, plane, msg):
                    return
        if time.monotonic() >= next_report:
            ticks += 1
            # Events go every period they happen in (placement reads the streams open);
            # the totals, which cost a collection of every family, once a second and only
            # when they changed; an idle process still says it lives once a second.
            second = ticks % TOTALS_EVERY == 0
            if plane.feed.pending() or second:
                report = plane.feed.take()
                families = families_of(plane.metrics.registry) if second else sent
                fresh = families if families != sent else None
                link.send(report.model_copy(update={"families": fresh}))
                sent = families
            next_report = time.monotonic() + REPORT_S
    log_event(log, "processes.orphaned", level=logging.ERROR, parent=parent)


def _handle(link: Link, plane: ChildPlane, msg: LinkMessage) -> bool:
    """Apply one message from the main process; ``False``: stop."""
    match msg:
        case AdmitStream():
            plane.replica.admit(msg.job, msg.rank)
            link.send(Ack(request=msg.request))
        case UpdateJob():
            plane.replica.update(msg.job)
            link.send(Ack(request=msg.request))
        case EndJob():
            plane.end_job(msg.job, ErrorCode(msg.code), msg.message)
        case Stop():
            return False
        case _:
            log_event(log, "processes.unexpected", level=logging.ERROR, kind=msg.kind)
    return True


def main() -> None:
    config = ChildConfig.model_validate_json(sys.stdin.buffer.read())
    settings = Settings.model_validate_json(config.settings)
    configure_logging(settings.log_format, settings.log_level)
    sys.exit(serve_child(config, settings))


if __name__ == "__main__":
    main()
