"""Expansions installed on this client: code of the trainer's own, named by a job's ``expand``
steps (the server only ever sees the name)."""

from __future__ import annotations

from collections.abc import Mapping

from ._ops import Expansion

# One table per process, as installed code is: a Loader copies it when it is made, so an
# expansion registered later never changes a running Loader.
_REGISTERED: dict[str, Expansion] = {}


def register_expansion(name: str, fn: Expansion) -> None:
    """Install ``fn`` as device step ``expand`` with ``fn=name`` for Loaders made after.

    >>> register_expansion("double", lambda x, options: x * 2)
    >>> "double" in registered()
    True
    """
    _REGISTERED[name] = fn


def registered() -> Mapping[str, Expansion]:
    """The expansions installed in this process, by name."""
    return dict(_REGISTERED)
