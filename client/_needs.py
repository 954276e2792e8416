"""The client's third-party imports, tried when this module is imported, before any other
module of the client, so that a server-only install (no torch) says in one line which extra it
lacks instead of a ``ModuleNotFoundError`` from deep inside the loader's modules."""

from __future__ import annotations

from importlib import import_module

#: What ``pip install 'shardserve[client]'`` brings, by import name.
NEEDS = ("torch", "zmq", "httpx")
EXTRA = "pip install 'shardserve[client]'"


def require() -> None:
    """Import each of :data:`NEEDS`; a missing one raises ``ImportError`` naming the extra."""
    for name in NEEDS:
        try:
            import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # the package is there but broken: its own error says more
                raise
            raise ImportError(
                f"shardserve.client needs {name}, which is not installed here: {EXTRA} "
                "(the trainer's extra; a server-only install has no torch)"
            ) from None


require()
