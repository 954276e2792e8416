"""Tensors built from real received ZeroMQ frames, and the pinned pool on a CPU-only host."""

from __future__ import annotations

import gc
import itertools
import logging
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import zmq

from shardserve.client import BadRequest, VarTensor
from shardserve.client.buffers import PinnedPool, batch_from_frames
from shardserve.client.device import DeviceCopier, resolve_device
from shardserve.proto.framing import decode_batch, encode_batch
from shardserve.proto.messages import BatchHeader, PartHeader


@pytest.fixture
def pair(tmp_path) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
    a.bind(f"ipc://{tmp_path}/p.sock")
    b.connect(f"ipc://{tmp_path}/p.sock")
    yield a, b
    a.close()
    b.close()
    ctx.term()


def _send(sock: zmq.Socket, index: int, arrays: dict[str, np.ndarray]) -> None:
    parts = tuple(PartHeader(k, str(v.dtype), v.shape, v.nbytes) for k, v in arrays.items())
    sock.send_multipart(
        encode_batch(BatchHeader(1, 0, index, parts), list(arrays.values())), copy=False
    )


def _recv(sock: zmq.Socket, pad: bool = False) -> dict:
    header, frames = decode_batch(sock.recv_multipart(copy=False))
    return batch_from_frames(header, frames, pad)


def test_each_batch_owns_its_storage(pair) -> None:
    """Two received batches never share memory; writing one leaves the other intact; no warning."""
    a, b = pair
    img = np.arange(8 * 3 * 4, dtype=np.float32).reshape(8, 3, 4)
    for i in range(2):
        _send(a, i, {"image": img, "label": np.arange(8, dtype=np.int64)})
    first, second = _recv(b), _recv(b)
    assert first["image"].shape == (8, 3, 4) and first["image"].dtype == torch.float32
    first["image"].fill_(-1)
    first["label"].fill_(-1)
    assert torch.equal(second["image"], torch.from_numpy(img))
    assert torch.equal(second["label"], torch.arange(8))
    spans = [(t.data_ptr(), t.data_ptr() + t.nbytes) for bt in (first, second) for t in bt.values()]
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)), spans


def test_tensor_keeps_its_frame_alive(pair) -> None:
    """A delivered tensor stays valid after every reference to the zmq frame is gone."""
    a, b = pair
    img = np.full((4, 1024), 7, dtype=np.uint8)
    _send(a, 0, {"image": img})
    t = _recv(b)["image"]
    gc.collect()
    _send(a, 1, {"image": np.zeros_like(img)})  # new allocations must not reuse t's memory
    _recv(b)
    assert int(t.sum()) == 7 * img.size


def test_variable_and_binary_fields(pair) -> None:
    """`x`+`x.offsets`+`x.shapes` becomes a VarTensor (or padded + lengths); binary -> uint8 VarTensor."""
    a, b = pair
    arrays = {
        "x": np.arange(5 * 2, dtype=np.float32),
        "x.offsets": np.array([0, 4, 10], dtype=np.int64),
        "x.shapes": np.array([[2, 2], [3, 2]], dtype=np.int64),
        "s": np.frombuffer(b"abcde", dtype=np.uint8),
        "s.offsets": np.array([0, 2, 5], dtype=np.int64),
    }
    _send(a, 0, arrays)
    _send(a, 1, arrays)
    batch = _recv(b)
    assert isinstance(batch["x"], VarTensor) and [t.shape for t in batch["x"].unbind()] == [
        (2, 2),
        (3, 2),
    ]
    assert [bytes(t.numpy()) for t in batch["s"].unbind()] == [b"ab", b"cde"]
    padded = _recv(b, pad=True)
    assert padded["x"].shape == (2, 3, 2) and padded["x.lengths"].tolist() == [[2, 2], [3, 2]]
    assert padded["s"].shape == (2, 3) and padded["s.lengths"].tolist() == [2, 3]


class _Done:
    """A stand-in for torch.cuda.Event: completed once `done` is set."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_pool_reuses_a_block_only_after_its_event(caplog) -> None:
    """Without CUDA the pool says once that it cannot pin, and never hands out a block in flight."""
    with caplog.at_level(logging.WARNING, logger="shardserve.client.buffers"):
        pool = PinnedPool(pin=True)
    assert pool.pin is False and "pinned host memory needs CUDA" in caplog.text
    blk = pool.acquire(10_000)
    assert blk.numel() == 16384 and not blk.is_pinned()
    ev = _Done()
    pool.release(blk, ev)
    other = pool.acquire(10_000)
    assert other.data_ptr() != blk.data_ptr()
    assert pool.stats() == {"allocated": 2, "free": 0, "pending": 1}
    ev.done = True
    again = pool.acquire(9_000)
    assert again.data_ptr() == blk.data_ptr()


def test_cpu_copier_passes_batches_through() -> None:
    """On the CPU the copier neither copies nor pins; staging packs parts into one aligned block."""
    copier = DeviceCopier(resolve_device("cpu", 0))
    parts = {"a": torch.arange(3, dtype=torch.float64), "b": torch.ones(2, 5, dtype=torch.uint8)}
    out = copier.to_device(parts)
    assert out["a"].data_ptr() == parts["a"].data_ptr()
    _, staged = copier.stage(parts)
    assert torch.equal(staged["b"], parts["b"]) and staged["b"].data_ptr() % 64 == 0
    assert staged["a"].data_ptr() != parts["a"].data_ptr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_device_without_cuda_is_refused() -> None:
    """Asking for device='cuda' on a CPU-only torch is a BadRequest that says what to use."""
    with pytest.raises(BadRequest, match="device='cpu'"):
        resolve_device("cuda", 0)


def test_copy_blocks_reuse_only_unreferenced_memory() -> None:
    """A copy-out block is reused only once no tensor of the batch that used it is alive."""
    from shardserve.client.buffers import CopyBlocks

    blocks = CopyBlocks(keep=2)
    src = {"x": torch.arange(1000, dtype=torch.float32)}
    first = blocks.copy_out(src)
    second = blocks.copy_out(src)
    assert first["x"].data_ptr() != second["x"].data_ptr()  # both alive: never shared
    ptr = first["x"].data_ptr()
    del first
    third = blocks.copy_out({"x": torch.ones(1000)})
    assert third["x"].data_ptr() == ptr  # the freed block comes back, already faulted in
    assert torch.equal(second["x"], torch.arange(1000, dtype=torch.float32))


class _CopyInFlight:
    """Stands in for a ``torch.cuda.Event`` of a device copy that has not finished yet."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def test_pinned_pool_waits_for_the_oldest_copy_instead_of_growing() -> None:
    """With every block still read by a copy, acquire waits for the oldest one and reuses it:
    pinned memory stays bounded however far the consumer's stream lags behind."""
    pool = PinnedPool(pin=False, max_blocks=3)
    events = []
    for _ in range(3):
        buf = pool.acquire(1000)
        events.append(_CopyInFlight())
        pool.release(buf, events[-1])
    first = pool.stats()
    assert first == {"allocated": 3, "free": 0, "pending": 3}
    again = pool.acquire(1000)
    assert events[0].waited == 1 and events[1].waited == 0, "did not wait for the oldest copy"
    assert pool.allocated == 3 and again.numel() == pool.size_class(1000)
