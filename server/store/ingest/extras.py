"""Optional readers' packages, imported when a format needs them, with an error that names
the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from shardserve.proto.errors import InvalidDataError

EXTRA = "shardserve[formats]"


def require(module: str, fmt: str) -> ModuleType:
    """``import module``, or ``InvalidDataError`` saying which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise InvalidDataError(
            f"reading {fmt} needs the {module!r} package: pip install '{EXTRA}' (or {module})"
        ) from None
