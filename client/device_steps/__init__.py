"""Steps the trainer's device executes on parameters the server drew: JPEG/PNG decode,
random resized crop, random crop, flip, resize, normalize, bit unpacking and expansions of
your own, installed here (never sent over the wire).

    from shardserve.client import Loader
    from shardserve.client.device_steps import register_expansion

    register_expansion("shogi", featurize)            # fn(tensor on device, options) -> tensor
    loader = Loader(url, dataset="shogi", batch_size=1024, device="cuda",
                    device_transforms=[{"name": "expand", "params": {"fn": "shogi",
                                                                     "field": "board"}}])

The codec: torchvision's ``decode_jpeg(device="cuda")`` where torchvision imports (the
``gpu-decode`` path), else Pillow on the CPU (the ``images`` extra), counted in
:meth:`DeviceSteps.stats`.
"""

from __future__ import annotations

from collections.abc import Mapping

from ._executor import MAX_STAGED, DeviceSteps, with_device_steps
from ._ops import Expansion

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


__all__ = [
    "MAX_STAGED",
    "DeviceSteps",
    "Expansion",
    "register_expansion",
    "registered",
    "with_device_steps",
]
