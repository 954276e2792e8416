"""Decoding a batch's encoded images onto the device: a codec chosen once, from a table.

``nvjpeg``: torchvision's ``decode_jpeg(device="cuda")``, batched on the GPU (when
torchvision imports beside the installed torch and the device is CUDA); a sample it cannot
take (PNG, a JPEG it refuses) is decoded by Pillow on the CPU and counted. ``pillow``: every
sample on the CPU, one at a time (CI's path, and a GPU host without torchvision). Why not
nvImageCodec: it is a separate CUDA wheel, and fails in forked DataLoader workers; torchvision
comes with most CUDA torch installs already.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Literal, Protocol

import numpy as np
import torch

from shardserve.proto.errors import BadRequest

from ._images import Images

Mode = Literal["RGB", "L"]
_JPEG = b"\xff\xd8\xff"


@dataclass
class DecodeCounts:
    """How many images each way decoded: ``device`` (the GPU codec) or ``cpu`` (Pillow,
    including the GPU codec's fallbacks, ``cpu_fallback``)."""

    device: int = 0
    cpu: int = 0
    cpu_fallback: int = 0


class Decoder(Protocol):
    """Decodes one batch's encoded samples (CPU uint8 tensors) to :class:`Images` on
    ``device``; called on the consumer's thread, inside the executor's stream."""

    name: str

    def decode(
        self, encoded: list[torch.Tensor], mode: Mode, device: torch.device, counts: DecodeCounts
    ) -> Images: ...


def _pil() -> ModuleType:
    try:
        from PIL import Image
    except ImportError:
        raise BadRequest(
            "decode_image on the CPU needs Pillow: pip install 'shardserve[images]' on the "
            "trainer (or torchvision with a CUDA device for the GPU decoder)"
        ) from None
    return Image


def pil_decode(data: torch.Tensor, mode: Mode) -> np.ndarray:
    """One encoded sample to uint8 ``[H, W, C]`` with Pillow (full size, no draft scaling)."""
    image = _pil()
    with image.open(io.BytesIO(data.numpy().tobytes())) as im:
        arr = np.array(im.convert(mode))  # writable: torch shares it
    return arr if arr.ndim == 3 else arr[:, :, None]


class PillowDecoder:
    """Every sample with Pillow on the CPU, then one copy of them all to ``device``."""

    name = "pillow"

    def decode(
        self, encoded: list[torch.Tensor], mode: Mode, device: torch.device, counts: DecodeCounts
    ) -> Images:
        arrays = [pil_decode(e, mode) for e in encoded]
        counts.cpu += len(arrays)
        return Images.from_hwc([torch.from_numpy(a) for a in arrays], device)


class NvjpegDecoder:
    """JPEGs batched through ``torchvision.io.decode_jpeg(device=...)``; anything else (or a
    JPEG the GPU codec refuses) by Pillow, counted as a CPU fallback."""

    name = "nvjpeg"

    def __init__(self, io_mod: ModuleType) -> None:
        self._io = io_mod

    def _batch(
        self, data: list[torch.Tensor], read: object, device: torch.device
    ) -> list[torch.Tensor]:
        """One batched call (torchvision >= 0.19 takes a list); one call a sample before."""
        try:
            return list(self._io.decode_jpeg(data, mode=read, device=device))
        except TypeError:
            return [self._io.decode_jpeg(d, mode=read, device=device) for d in data]

    def decode(
        self, encoded: list[torch.Tensor], mode: Mode, device: torch.device, counts: DecodeCounts
    ) -> Images:
        jpeg = [i for i, e in enumerate(encoded) if bytes(e[:3].tolist()) == _JPEG]
        out: list[torch.Tensor | None] = [None] * len(encoded)
        read = self._io.ImageReadMode.RGB if mode == "RGB" else self._io.ImageReadMode.GRAY
        if jpeg:
            try:
                got = self._batch([encoded[i] for i in jpeg], read, device)
            except RuntimeError:
                jpeg = []  # one bad JPEG fails the batch call: decode them all on the CPU
            else:
                for i, chw in zip(jpeg, got, strict=True):
                    out[i] = chw.permute(1, 2, 0)
                counts.device += len(jpeg)
        for i, e in enumerate(encoded):
            if out[i] is None:
                out[i] = torch.from_numpy(pil_decode(e, mode)).to(device, non_blocking=False)
                counts.cpu += 1
                counts.cpu_fallback += 1
        return Images.from_hwc([t for t in out if t is not None], device)


def _torchvision_io() -> ModuleType | None:
    """torchvision's ``io`` when it imports beside this torch (PyPI's torchvision does not
    beside the CPU build CI uses: ``operator torchvision::nms does not exist``)."""
    try:
        import torchvision.io as tvio
    except Exception:  # ImportError, or the RuntimeError of a mismatched build
        return None
    return tvio


def choose_decoder(device: torch.device, prefer: str = "auto") -> Decoder:
    """The codec for ``device``: ``nvjpeg`` on CUDA where torchvision imports, else
    ``pillow``; ``prefer="pillow"`` forces the CPU codec (for comparisons).

    >>> choose_decoder(torch.device("cpu")).name
    'pillow'
    """
    table: dict[str, Callable[[], Decoder | None]] = {
        "pillow": PillowDecoder,
        "nvjpeg": lambda: NvjpegDecoder(io) if (io := _torchvision_io()) is not None else None,
    }
    if prefer not in ("auto", *table):
        raise BadRequest(f"decoder={prefer!r}: use 'auto', 'nvjpeg' or 'pillow'")
    if prefer == "auto":
        prefer = "nvjpeg" if device.type == "cuda" else "pillow"
    got = table[prefer]()
    return got if got is not None else PillowDecoder()
