"""Images of different sizes in one flat device tensor, and the batched bilinear resampling
of a box of each into one ``[B, oh, ow, C]`` tensor (one gather for the whole batch).

The arithmetic is the server's ``random_resized_crop``/``resize`` with ``method="numpy"``
(half-pixel centres, clamped to the image, float32 weights, no antialiasing), so on the CPU
the same box gives the same bytes as the server's full decode plus that resampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Images:
    """``B`` uint8 HWC images of sizes ``hw[i]`` with ``c`` channels, back to back in
    ``values`` (image ``i`` starts at ``starts[i]``), all on one device."""

    values: torch.Tensor
    starts: torch.Tensor
    hw: torch.Tensor
    c: int

    @staticmethod
    def from_hwc(images: list[torch.Tensor], device: torch.device) -> Images:
        """Images from per-sample ``[H, W, C]`` tensors (copied once, to ``device``)."""
        c = int(images[0].shape[2]) if images else 3
        flat = (
            torch.cat([t.reshape(-1).to(device) for t in images])
            if images
            else (torch.empty(0, dtype=torch.uint8, device=device))
        )
        sizes = torch.tensor([t.numel() for t in images], dtype=torch.int64)
        starts = torch.zeros(len(images), dtype=torch.int64)
        if len(images) > 1:
            starts[1:] = torch.cumsum(sizes, 0)[:-1]
        hw = torch.tensor([[int(t.shape[0]), int(t.shape[1])] for t in images], dtype=torch.int64)
        return Images(flat, starts.to(device), hw.to(device), c)

    @staticmethod
    def from_dense(x: torch.Tensor) -> Images:
        """Images from a dense ``[B, H, W, C]`` tensor (a view, no copy)."""
        b, h, w, c = x.shape
        dev = x.device
        starts = torch.arange(b, device=dev, dtype=torch.int64) * (h * w * c)
        hw = torch.tensor([[h, w]], dtype=torch.int64, device=dev).expand(b, 2)
        return Images(x.reshape(-1), starts, hw, int(c))

    def whole(self) -> torch.Tensor:
        """Each image's box ``(0, 0, H, W)``: ``float64 [B, 4]``."""
        z = torch.zeros_like(self.hw)
        return torch.cat([z, self.hw], 1).to(torch.float64)


def _axis(
    lo: torch.Tensor, span: torch.Tensor, n: int, limit: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Source coordinates of ``n`` output pixels over ``[lo, lo + span)`` of a side of
    ``limit`` pixels, per sample: (index below, index above, float32 weight of above)."""
    dev = lo.device
    centres = torch.arange(n, device=dev, dtype=torch.float64) + 0.5
    pos = lo[:, None] + centres[None, :] * (span / n)[:, None] - 0.5
    top = (limit - 1).to(torch.float64)[:, None]
    pos = torch.minimum(torch.clamp(pos, min=0.0), top)
    i0 = torch.floor(pos)
    w = (pos - i0).to(torch.float32)
    i0l = i0.to(torch.int64)
    i1 = torch.minimum(i0l + 1, (limit - 1)[:, None])
    return i0l, i1, w


def resample(images: Images, boxes: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Box ``(y0, x0, h, w)`` of each image (``float64 [B, 4]``) bilinearly resampled to
    ``size``: uint8 ``[B, oh, ow, C]``."""
    oh, ow = size
    b, c = boxes.shape[0], images.c
    dev = images.values.device
    if b == 0:
        return torch.empty((0, oh, ow, c), dtype=torch.uint8, device=dev)
    boxes = boxes.to(dev, torch.float64)
    H, W = images.hw[:, 0], images.hw[:, 1]
    y0, y1, wy = _axis(boxes[:, 0], boxes[:, 2], oh, H)
    x0, x1, wx = _axis(boxes[:, 1], boxes[:, 3], ow, W)
    # Every image starts on a whole pixel: gather pixels (rows of C bytes), not bytes.
    pixels = images.values.view(-1, c)
    base = (images.starts // c)[:, None, None]
    row_stride = W[:, None, None]

    def gather(ys: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        at = base + ys[:, :, None] * row_stride + xs[:, None, :]  # [B, oh, ow] pixel indices
        return pixels[at].to(torch.float32)  # [B, oh, ow, C]

    wx4 = wx[:, None, :, None]
    wy4 = wy[:, :, None, None]
    top = gather(y0, x0) * (1 - wx4) + gather(y0, x1) * wx4
    bot = gather(y1, x0) * (1 - wx4) + gather(y1, x1) * wx4
    out = top * (1 - wy4) + bot * wy4
    return torch.clamp(torch.round(out), 0, 255).to(torch.uint8)
