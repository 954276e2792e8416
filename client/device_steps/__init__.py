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

from ._executor import MAX_STAGED, DeviceSteps, with_device_steps
from ._ops import Expansion
from ._registry import register_expansion, registered

__all__ = [
    "MAX_STAGED",
    "DeviceSteps",
    "Expansion",
    "register_expansion",
    "registered",
    "with_device_steps",
]
