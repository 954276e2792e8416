"""What a streaming process is started with, and where it listens."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict


class ChildConfig(BaseModel):
    """What a streaming process is started with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int
    processes: int
    link: str
    data_endpoints: list[str]
    #: The server's settings as JSON (``Settings.model_dump_json``).
    settings: str


def child_endpoints(endpoints: list[str], k: int) -> list[str]:
    """The data endpoints of streaming process ``k``: an ipc socket beside the main one
    (``data.sock`` -> ``data-2.sock``), a tcp port ``k`` above the main one (``:0`` stays
    ephemeral).

    >>> child_endpoints(["ipc:///run/ss/data.sock", "tcp://127.0.0.1:7071"], 2)
    ['ipc:///run/ss/data-2.sock', 'tcp://127.0.0.1:7073']
    >>> child_endpoints(["tcp://127.0.0.1:0"], 1)
    ['tcp://127.0.0.1:0']
    """
    out = []
    for e in endpoints:
        if e.startswith("ipc://"):
            stem, dot, ext = e.rpartition(".")
            out.append(f"{stem}-{k}.{ext}" if dot and "/" not in ext else f"{e}-{k}")
            continue
        parts = urlsplit(e)
        port = parts.port or 0
        host = parts.netloc.rsplit(":", 1)[0]
        out.append(urlunsplit(parts._replace(netloc=f"{host}:{port + k if port else 0}")))
    return out
