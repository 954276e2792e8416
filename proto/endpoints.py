"""How a data plane is reached: endpoint schemes, delivery kinds and which hosts are loopback.

Pure functions over strings; both the server (bind checks, the ``Host`` allow-list) and the
client (endpoint choice, proxy bypass) read them here, so the two sides agree on what
"loopback" means.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

#: A data endpoint's scheme: ``tcp://HOST:PORT`` or ``ipc:///path/to.sock``.
Scheme = Literal["tcp", "ipc"]
SCHEMES: tuple[Scheme, ...] = ("tcp", "ipc")
#: How a stream's batches travel: in shared-memory slots (same host) or in socket frames.
Delivery = Literal["shm", "socket"]

#: Names that always mean this machine, besides the loopback address ranges.
LOOPBACK_NAMES: tuple[str, ...] = ("localhost", "ip6-localhost")
#: Bind addresses that listen on every interface (``""`` and ``*`` as some tools spell it).
WILDCARD_HOSTS: tuple[str, ...] = ("0.0.0.0", "::", "*", "")


def split_host_port(addr: str) -> tuple[str, int]:
    """``"127.0.0.1:7070"`` -> ``("127.0.0.1", 7070)``; ``"[::1]:80"`` -> ``("::1", 80)``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"address {addr!r} must be HOST:PORT, e.g. 127.0.0.1:7070")
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"port {port} in {addr!r} is outside 0..65535")
    return host.strip("[]"), int(port)


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` names only this machine: a loopback address or a loopback name.

    A wildcard bind address (``0.0.0.0``, ``::``) is *not* loopback: bound to, it listens on
    every interface.

    >>> [is_loopback_host(h) for h in ("127.0.0.2", "[::1]", "LocalHost", "0.0.0.0", "h.example")]
    [True, True, True, False, False]
    """
    h = host.strip("[]").lower()
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False  # a hostname may be reachable from outside


def is_wildcard_host(host: str) -> bool:
    """Whether ``host`` is a bind-to-every-interface address (``0.0.0.0``, ``::``, ``*``)."""
    return host.strip("[]") in WILDCARD_HOSTS


def reaches_this_host(host: str) -> bool:
    """Whether connecting to ``host`` stays on this machine: loopback, or a wildcard address
    (which the kernel routes to this host when connected to)."""
    return is_loopback_host(host) or is_wildcard_host(host)


def endpoint_scheme(endpoint: str) -> Scheme:
    """The scheme of a data endpoint; a ``ValueError`` that says what to write otherwise."""
    scheme, sep, _ = endpoint.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"data endpoint {endpoint!r} must start with tcp:// or ipc://")
    return "tcp" if scheme == "tcp" else "ipc"


def tcp_host(endpoint: str) -> str | None:
    """The host of a ``tcp://`` endpoint; ``None`` for ``ipc://``, which never leaves the host."""
    if endpoint_scheme(endpoint) != "tcp":
        return None
    return split_host_port(endpoint.partition("://")[2])[0]
