"""Keyword-only arguments that old callers still pass by position: accepted, with a warning."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., None])


def positional_deprecated(init: _F) -> _F:
    """Arguments after ``batch_size`` are keyword-only; a call that still passes them by
    position (in the order they had before) works, with a ``DeprecationWarning``.

    Example: ``@positional_deprecated`` on ``Loader.__init__``.
    """
    params = list(inspect.signature(init).parameters.values())
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD][1:]  # no self
    keyword = [p.name for p in params if p.kind is p.KEYWORD_ONLY]

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        extra = args[len(positional) :]
        if extra:
            if len(extra) > len(keyword):
                raise TypeError(
                    f"Loader() takes at most {len(positional) + len(keyword)} arguments"
                )
            names = keyword[: len(extra)]
            twice = [n for n in names if n in kwargs]
            if twice:
                raise TypeError(f"Loader() got multiple values for {twice}")
            warnings.warn(
                f"Loader arguments after batch_size are keyword-only: pass "
                f"{', '.join(f'{n}=' for n in names)} by name",
                DeprecationWarning,
                stacklevel=2,
            )
            kwargs.update(zip(names, extra, strict=True))
            args = args[: len(positional)]
        init(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
