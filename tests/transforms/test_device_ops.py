"""The device steps on ``cpu`` against the server's numpy transforms, on fixed parameters.

Tolerance: the device path decodes with Pillow at full size and resamples with the server's
``method="numpy"`` arithmetic, so on the CPU pixels agree exactly (max abs difference 0);
normalize agrees to float32 rounding; ``unpack_bits`` is exact.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from shardserve.client.device_steps import DeviceSteps
from shardserve.client.device_steps._images import Images, resample
from shardserve.client.device_steps._ops import unpack_torch
from shardserve.client.types import VarTensor
from shardserve.proto.errors import BadRequest
from shardserve.server.transforms.builtins import _bilinear

PIL = pytest.importorskip("PIL.Image")
CPU = torch.device("cpu")


def _jpegs(sizes: list[tuple[int, int]], fmt: str = "JPEG") -> tuple[list[np.ndarray], VarTensor]:
    rng = np.random.default_rng(0)
    enc = []
    for h, w in sizes:
        a = (rng.random((h, w, 3)) * 255).astype(np.uint8)
        buf = io.BytesIO()
        PIL.fromarray(a).save(buf, format=fmt)
        enc.append(np.frombuffer(buf.getvalue(), np.uint8))
    offs = torch.tensor(np.concatenate([[0], np.cumsum([len(e) for e in enc])]))
    var = VarTensor(torch.from_numpy(np.concatenate(enc)), offs, (offs[1:] - offs[:-1])[:, None])
    return enc, var


def _full_decode(e: np.ndarray) -> np.ndarray:
    return np.asarray(PIL.open(io.BytesIO(e.tobytes())).convert("RGB"))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_decode_crop_flip_equals_server_arithmetic(fmt: str) -> None:
    """Decode + resized crop + flip on cpu equal the server's full decode and bilinear resampler."""
    enc, var = _jpegs([(40, 60), (57, 33), (80, 80), (31, 90)], fmt)
    boxes = torch.tensor([[3, 5, 20, 30], [0, 0, 57, 33], [10, 10, 50, 40], [1, 2, 29, 80.0]])
    flips = torch.tensor([1, 0, 1, 0], dtype=torch.uint8)
    run = DeviceSteps(
        [
            {"name": "decode_image"},
            {"name": "random_resized_crop", "params": {"size": [16, 20]}},
            {"name": "hflip"},
        ],
        offset=0,
        device=CPU,
    )
    out = run({"image": var, "_device_1_box": boxes, "_device_2_flip": flips, "y": torch.ones(4)})
    assert set(out) == {"image", "y"}  # the parameter fields are dropped
    for i, e in enumerate(enc):
        y0, x0, h, w = boxes[i].tolist()
        ref = _bilinear(_full_decode(e), y0, x0, h, w, 16, 20, 0, 1)
        ref = ref[:, ::-1] if flips[i] else ref
        diff = np.abs(ref.astype(np.int16) - out["image"][i].numpy().astype(np.int16))
        assert diff.max() == 0, (i, diff.max(), diff.mean())
    assert run.stats()["cpu_decodes"] == 4


def test_resample_matches_numpy_on_dense_batch() -> None:
    """Resizing a dense uint8 batch equals the server's numpy bilinear per sample."""
    x = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (3, 33, 47, 3), dtype=np.uint8))
    got = resample(Images.from_dense(x), Images.from_dense(x).whole(), (19, 64))
    for i in range(3):
        ref = _bilinear(x[i].numpy(), 0, 0, 33, 47, 19, 64, 0, 1)
        assert np.array_equal(ref, got[i].numpy())


def test_random_crop_and_normalize_chw() -> None:
    """A padded random crop at given offsets, then normalize to CHW float, equal numpy's."""
    x = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8))
    off = torch.tensor([[0, 4], [3, 1]])
    steps = [
        {"name": "random_crop", "params": {"size": 6, "padding": 2, "fill": 7}},
        {
            "name": "normalize",
            "params": {
                "mean": [1.0, 2.0, 3.0],
                "std": [2.0, 4.0, 8.0],
                "scale": 0.5,
                "to_chw": True,
            },
        },
    ]
    out = DeviceSteps(steps, offset=3, device=CPU)({"image": x, "_device_3_offset": off})["image"]
    padded = np.pad(x.numpy(), [(0, 0), (2, 2), (2, 2), (0, 0)], constant_values=7)
    for i, (oy, ox) in enumerate(off.tolist()):
        crop = padded[i, oy : oy + 6, ox : ox + 6].astype(np.float32) * np.float32(0.5)
        ref = ((crop - np.float32([1, 2, 3])) / np.float32([2, 4, 8])).transpose(2, 0, 1)
        assert np.array_equal(ref, out[i].numpy())


@pytest.mark.parametrize("bitorder", ["big", "little"])
def test_unpack_bits_exact(bitorder: str) -> None:
    """Unpacking on the device equals numpy.unpackbits bit for bit."""
    x = np.random.default_rng(3).integers(0, 256, (5, 13), dtype=np.uint8)
    steps = [
        {
            "name": "unpack_bits",
            "params": {
                "field": "b",
                "shape": [2, 50],
                "to": "p",
                "dtype": "float32",
                "bitorder": bitorder,
            },
        }
    ]
    out = DeviceSteps(steps, offset=0, device=CPU)({"b": torch.from_numpy(x)})
    ref = np.unpackbits(x, axis=1, count=100, bitorder=bitorder).reshape(5, 2, 50)
    assert np.array_equal(out["p"].numpy(), ref.astype(np.float32))


def test_unpack_torch_equals_numpy() -> None:
    """The tensor-op unpacking (the GPU path) equals numpy.unpackbits in both bit orders."""
    x = np.random.default_rng(4).integers(0, 256, (3, 9), dtype=np.uint8)
    for order in ("big", "little"):
        got = unpack_torch(torch.from_numpy(x), 70, order).numpy()
        assert np.array_equal(got, np.unpackbits(x, axis=1, count=70, bitorder=order))


def test_expansion_must_be_registered() -> None:
    """An expand step naming no registered expansion is refused, listing the registered ones."""
    with pytest.raises(BadRequest, match="twice"):
        DeviceSteps(
            [{"name": "expand", "params": {"fn": "nope", "field": "b"}}],
            offset=0,
            device=CPU,
            expansions={"twice": lambda t, o: t * 2},
        )
    ok = DeviceSteps(
        [{"name": "expand", "params": {"fn": "twice", "field": "b", "to": "c"}}],
        offset=0,
        device=CPU,
        expansions={"twice": lambda t, o: t * 2},
    )
    assert ok({"b": torch.ones(2)})["c"].tolist() == [2.0, 2.0]


def test_unknown_step_is_refused() -> None:
    """A device step that does not exist is refused naming those that do."""
    with pytest.raises(BadRequest, match="random_resized_crop"):
        DeviceSteps([{"name": "blur"}], offset=0, device=CPU)


class _StandInIO:
    """torchvision.io's surface that the GPU codec uses, decoding with Pillow (CI has no
    torchvision beside its CPU torch): the codec's routing and counting are what is tested."""

    class ImageReadMode:
        RGB, GRAY = "RGB", "L"

    @staticmethod
    def decode_jpeg(
        data: list[torch.Tensor], mode: str, device: torch.device
    ) -> list[torch.Tensor]:
        return [
            torch.from_numpy(_full_decode(d.numpy()).copy()).permute(2, 0, 1).to(device)
            for d in data
        ]


def test_gpu_codec_routes_pngs_to_pillow_and_counts_them() -> None:
    """JPEGs go to the batched codec, a PNG falls back to Pillow and is counted; same pixels."""
    from shardserve.client.device_steps._codec import DecodeCounts, NvjpegDecoder, PillowDecoder

    _, var = _jpegs([(20, 30), (25, 17)])
    _, pvar = _jpegs([(11, 13)], "PNG")
    data = [*var.unbind(), *pvar.unbind()]
    counts = DecodeCounts()
    got = NvjpegDecoder(_StandInIO).decode(data, "RGB", CPU, counts)  # type: ignore[arg-type]
    want = PillowDecoder().decode(data, "RGB", CPU, DecodeCounts())
    assert (counts.device, counts.cpu, counts.cpu_fallback) == (2, 1, 1)
    assert torch.equal(got.values, want.values) and torch.equal(got.hw, want.hw)
