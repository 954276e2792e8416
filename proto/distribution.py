"""The distribution's version: stated once, in ``pyproject.toml`` (``[project] version``), and
read from the installed metadata here. ``shardserve --version``, ``shardserve.proto.__version__`` and
``shardserve.client.__version__`` all come from this (``shardserve.server`` keeps its
``__init__`` empty so that ``shardserve --help`` imports nothing it does not need).

``shardserve`` itself is a namespace package (the three folders proto/, server/ and client/
are mapped to ``shardserve.proto``, ``.server`` and ``.client``; nothing owns ``shardserve/``),
so there is no ``shardserve.__version__``: ask one of the three, or
``importlib.metadata.version("shardserve")``.

>>> from shardserve.proto.distribution import __version__
>>> __version__.count(".") >= 1
True
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "shardserve"


def installed_version() -> str:
    """The installed distribution's version; ``0+unknown`` when run from a bare checkout."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"


__version__ = installed_version()
