"""The optional C extensions of the transforms (``setup.py``): each module, or ``None`` where
the install had no C compiler. Their callers fall back to numpy, with the same bytes.

- ``windows`` (``_windows.c``): crop, flip and normalize of ``uint8`` images in one pass
  (:mod:`.onepass`).
- ``philox`` (``_philox.c``): the Philox4x32-10 blocks of a batch's draws (:mod:`.keys`).

>>> sorted(KERNELS)
['philox', 'windows']
"""

from __future__ import annotations

from types import ModuleType

windows: ModuleType | None
philox: ModuleType | None
try:
    from . import _windows as windows  # type: ignore[attr-defined,no-redef]
except ImportError:  # no C compiler at install: numpy runs instead
    windows = None
try:
    from . import _philox as philox  # type: ignore[attr-defined,no-redef]
except ImportError:
    philox = None

#: Each extension by name: built (importable here) or not. ``shardserve serve`` logs it.
KERNELS: dict[str, bool] = {"windows": windows is not None, "philox": philox is not None}
#: The extensions this install lacks (``.ci/run`` asserts there are none).
MISSING: list[str] = [name for name, built in KERNELS.items() if not built]
