"""Where to say a Hello on a server with streaming processes (``--stream-processes``).

The client asks the control plane which process serves its rank (``POST /v1/jobs/{id}/place``)
before its first Hello, and again whenever it re-opens a stream to recover (a process that
died, a Hello sent back); the epochs in between go where the rank was placed. Should the
control plane not answer, the Hello goes to the main process, which serves it or sends it
back to ask again: placement never stops a stream.
"""

from __future__ import annotations

import logging

from shardserve.proto.api import ServerInfo
from shardserve.proto.errors import ShardserveError
from shardserve.proto.messages import Hello
from shardserve.proto.processes import ADMIT_TIMEOUT_S, PlaceRequest

from .connection import choose_endpoint
from .job import JobHandle

log = logging.getLogger(__name__)

#: Seconds a placement may take: the server's wait for the process to confirm, and room.
PLACE_TIMEOUT_S = ADMIT_TIMEOUT_S + 5.0


class Placer:
    """Asks where each Hello of one job goes; ``main``: the main process's endpoint."""

    def __init__(self, job: JobHandle, info: ServerInfo, transport: str, main: str) -> None:
        self._job, self._info, self._transport, self._main = job, info, transport, main
        self._placed: dict[tuple[str, int], str] = {}

    def endpoint_for(self, hello: Hello, again: bool) -> str:
        """The data endpoint of the process placed to serve ``hello``'s rank; ``again``: ask
        anew (the stream is recovering)."""
        key = (hello.job, hello.rank)
        if not again and key in self._placed:
            return self._placed[key]
        self._placed[key] = where = self._ask(hello)
        return where

    def _ask(self, hello: Hello) -> str:
        req = PlaceRequest(rank=hello.rank)
        try:
            placed = self._job.api.place(self._job.id, req, timeout=PLACE_TIMEOUT_S)
        except ShardserveError as e:
            log.info(
                "placement of job %s rank %s failed (%s): asking the main process",
                hello.job,
                hello.rank,
                e,
            )
            return self._main
        info = self._info.model_copy(update={"data_endpoints": placed.data_endpoints})
        return choose_endpoint(info, self._job.api.host, self._transport)
