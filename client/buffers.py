"""Where earlier code imported the client's buffer helpers from (the name stays importable).

The code lives in two private modules: :mod:`._frames` (received bytes → tensors → fields) and
:mod:`._staging` (pinned buffers for device copies, copy-out blocks for shared memory).
"""

from ._frames import assemble, batch_from_frames, tensor_from_frame, torch_dtype, views_at
from ._ledger import Event
from ._staging import COUNTS_USERS, CopyBlocks, PinnedPool, pack_into, storage_users

__all__ = [
    "COUNTS_USERS",
    "CopyBlocks",
    "Event",
    "PinnedPool",
    "assemble",
    "batch_from_frames",
    "pack_into",
    "storage_users",
    "tensor_from_frame",
    "torch_dtype",
    "views_at",
]
