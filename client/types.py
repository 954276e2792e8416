"""The small types a :class:`~shardserve.client.Loader` hands back.

``VarTensor`` carries a variable-shape field of a batch (token sequences, graphs, encoded
images) the way it travels: one flat ``values`` tensor, ``offsets`` into it and each
sample's ``shapes``. It is cheap to move to a device and can be padded or split on demand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class VarTensor:
    """A batch of variable-shape samples: sample ``i`` is
    ``values[offsets[i]:offsets[i+1]].view(shapes[i])``.

    ``values`` is 1-d; ``offsets`` is int64 ``[B+1]`` (element offsets); ``shapes`` is int64
    ``[B, ndim]`` (binary fields: ``[B, 1]``, the byte length).

    >>> v = VarTensor(torch.arange(5.), torch.tensor([0, 2, 5]), torch.tensor([[2], [3]]))
    >>> [t.tolist() for t in v.unbind()]
    [[0.0, 1.0], [2.0, 3.0, 4.0]]
    >>> v.pad()[0].tolist()
    [[0.0, 1.0, 0.0], [2.0, 3.0, 4.0]]
    """

    values: torch.Tensor
    offsets: torch.Tensor
    shapes: torch.Tensor

    def __len__(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def unbind(self) -> list[torch.Tensor]:
        """One tensor per sample, each a view into ``values`` (no copy)."""
        offs = self.offsets.tolist()
        shapes = self.shapes.tolist()
        return [self.values[offs[i] : offs[i + 1]].view(shapes[i]) for i in range(len(self))]

    def pad(self, value: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A dense ``[B, *max_shape]`` tensor filled with ``value`` past each sample's end,
        and the true shapes (int64 ``[B, ndim]``).

        >>> VarTensor(torch.tensor([7, 8, 9]), torch.tensor([0, 1, 3]), torch.tensor([[1], [2]])).pad(-1)[0]
        tensor([[ 7, -1],
                [ 8,  9]])
        """
        n = len(self)
        ndim = int(self.shapes.shape[1]) if self.shapes.dim() == 2 else 1
        shapes = self.shapes.reshape(n, ndim)
        max_shape = shapes.amax(dim=0).tolist() if n else [0] * ndim
        out = torch.full((n, *max_shape), value, dtype=self.values.dtype, device=self.values.device)
        if out.numel() and self.values.numel():
            mask, block = _valid_mask(shapes, max_shape)
            if block == 1:
                out.view(mask.shape).masked_scatter_(mask, self.values)
            else:  # rows of a block each: boolean indexing moves rows (masked_scatter would not)
                out.view(*mask.shape, block)[mask] = self.values.view(-1, block)
        return out, self.shapes

    def to(self, device: torch.device | str, non_blocking: bool = False) -> VarTensor:
        """The same batch on ``device``."""
        return VarTensor(
            self.values.to(device, non_blocking=non_blocking),
            self.offsets.to(device, non_blocking=non_blocking),
            self.shapes.to(device, non_blocking=non_blocking),
        )


def _valid_mask(shapes: torch.Tensor, max_shape: list[int]) -> tuple[torch.Tensor, int]:
    """``True`` where a value of a :class:`VarTensor` lands in its ``[B, *max_shape]``
    padding, and the size of the blocks each ``True`` stands for.

    Filling a padded tensor through this mask (row-major, as ``values`` are laid out) puts
    every sample in place with one op, no loop over samples. Trailing dims every sample
    shares (``F`` of ``x[N, F]``) are left out of the mask and move as blocks.
    """
    n, ndim = shapes.shape
    full = (
        (shapes == torch.tensor(max_shape, device=shapes.device)).all(dim=0).tolist()
        if n
        else [True] * ndim
    )
    lead = ndim
    while lead and full[lead - 1]:
        lead -= 1
    block = 1
    for d in max_shape[lead:]:
        block *= d
    mask: torch.Tensor | None = None
    for d in range(lead):
        if full[d]:
            continue  # every sample spans this dim: nothing to mask
        view = [n] + [1] * lead
        view[d + 1] = max_shape[d]
        m = (
            torch.arange(max_shape[d], device=shapes.device)[None, :] < shapes[:, d : d + 1]
        ).reshape(view)
        mask = m if mask is None else mask & m
    shape = (n, *max_shape[:lead])
    mask = (
        torch.ones(shape, dtype=torch.bool, device=shapes.device)
        if mask is None
        else mask.expand(shape)
    )
    return mask, block


Batch = dict[str, "torch.Tensor | VarTensor"]


@dataclass(frozen=True)
class LoaderStats:
    """What the loop waited for. ``stall_fraction`` near 0 means data keeps up; near 1 means
    the model is waiting on data.

    Examples:
        >>> LoaderStats(batches=10, bytes=0, wait_s=1.0, compute_s=3.0, transport="tcp",
        ...             first_batch_s=0.01).stall_fraction
        0.25
    """

    batches: int
    bytes: int
    #: Seconds spent inside ``next()`` waiting for a batch.
    wait_s: float
    #: Seconds between a batch being handed out and the next one being asked for.
    compute_s: float
    #: The data-plane transport in use: ``"shm"``, ``"ipc"`` or ``"tcp"``.
    transport: str
    #: Seconds from construction of the Loader to its first delivered batch (None before).
    first_batch_s: float | None
    #: Times the stream was re-established after a server restart or a lost stream.
    reconnects: int = 0
    #: Shared-memory batches copied out because the loop still held half the ring's earlier
    #: batches (0 for a loop that keeps only the current batch: every batch stays in place).
    copied: int = 0
    #: Messages received: small batches travel several to a message (``batches / messages``).
    messages: int = 0
    #: Times a shared stream (``share=``) fell out of its group's window and went on on its
    #: own pass of the same plan: same bytes, no longer shared (the server's notice).
    detached: int = 0
    #: The device steps' counts (``device_transforms=``): batches, decodes on the device and
    #: on the CPU (fallbacks counted apart), pinned staging blocks; ``None`` without them.
    device: dict[str, Any] | None = None

    @property
    def stall_fraction(self) -> float:
        total = self.wait_s + self.compute_s
        return self.wait_s / total if total > 0 else 0.0
