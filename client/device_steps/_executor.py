"""Running a job's device steps on each received batch.

On CUDA, a batch's dense host parts (drawn parameters, packed bits, labels) are packed into
one pinned block from a pool of at most ``max_staged`` blocks, copied on a side stream, and
every step runs on that stream into fresh device storage; the consumer's stream waits on an
event recorded after the last step, and the pinned block is reused only after it. On the CPU
the same ops run in place of the copy, on the batch as received (CI's path).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from shardserve.proto import device_steps as ds
from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import JobSpec, TransformStep

from .._staging import PinnedPool, pack_into
from ..types import Batch, VarTensor
from ._codec import DecodeCounts, choose_decoder
from ._images import Images
from ._ops import OPS, Context, Expansion, check_expansion
from ._registry import registered

#: Pinned blocks a device's staging holds at most: one being copied, one being filled.
MAX_STAGED = 2


def with_device_steps(spec: JobSpec, steps: Sequence[Mapping[str, Any]]) -> JobSpec:
    """``spec`` asking for ``steps`` on the trainer's device (``BadRequest`` naming a bad one)."""
    ds.parse_steps(steps)
    return JobSpec.model_validate(
        {
            **spec.model_dump(),
            "device_transforms": tuple(TransformStep.model_validate(s) for s in steps),
        }
    )


def attach(
    spec: JobSpec,
    steps: Sequence[Mapping[str, Any]] | None,
    device: torch.device,
    resident: bool = False,
) -> tuple[JobSpec, torch.device, DeviceSteps | None]:
    """What a Loader with ``device_transforms=steps`` runs: its job, where batches land before
    the steps (the host), and the steps (``None``: no steps, batches land on ``device``)."""
    if steps is None:
        return spec, device, None
    if resident:
        raise BadRequest(
            "resident mode gathers the stored fields in this process; it cannot "
            "run device_transforms: leave resident out"
        )
    spec = with_device_steps(spec, steps)
    run = DeviceSteps(spec.device_transforms or (), len(spec.transforms or ()), device)
    return spec, torch.device("cpu"), run


def then(
    first: DeviceSteps | None, rest: Callable[[Batch], Any] | None
) -> Callable[[Batch], Any] | None:
    """``first`` then ``rest`` on each batch (either may be absent)."""
    if first is None:
        return rest
    if rest is None:
        return first
    return lambda b: rest(first(b))


class DeviceSteps:
    """Executes a job's ``device_transforms`` on each batch, on ``device``.

    >>> run = DeviceSteps([{"name": "unpack_bits", "params": {"field": "x", "shape": [4]}}],
    ...                   offset=0, device=torch.device("cpu"))
    >>> run({"x": torch.tensor([[0b10100000]], dtype=torch.uint8)})["x"].tolist()
    [[1, 0, 1, 0]]
    """

    def __init__(
        self,
        steps: Sequence[Mapping[str, Any] | TransformStep],
        offset: int,
        device: torch.device,
        decoder: str = "auto",
        expansions: Mapping[str, Expansion] | None = None,
        max_staged: int = MAX_STAGED,
    ) -> None:
        self.steps = ds.parse_steps(steps)
        self.offset = offset
        self.device = device
        self.cuda = device.type == "cuda"
        self.counts = DecodeCounts()
        if expansions is None:
            expansions = registered()
        self.ctx = Context(device, choose_decoder(device, decoder), self.counts, dict(expansions))
        for _, p in self.steps:
            if isinstance(p, ds.Expand):  # refused as the Loader is made, not at a batch
                check_expansion(p, self.ctx.expansions)
        self.pool = PinnedPool(pin=self.cuda, max_blocks=max_staged)
        self._stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.batches = 0
        self.seconds = 0.0

    def _drawn(self, batch: dict[str, Any], i: int, name: str) -> dict[str, torch.Tensor]:
        return {w: batch[ds.param_field(self.offset + i, w)] for w in ds.DRAWN.get(name, {})}

    def _run(self, state: dict[str, Any]) -> Batch:
        for i, (name, params) in enumerate(self.steps):
            OPS[name](state, params, self._drawn(state, i, name), self.ctx)
        out: Batch = {}
        for k, v in state.items():
            if k.startswith(ds.PARAM_PREFIX):
                continue
            out[k] = _var(v) if isinstance(v, Images) else v
        return out

    def __call__(self, batch: Batch) -> Batch:
        """The batch with every step executed, on ``device``, parameter fields dropped."""
        t0 = time.perf_counter()
        if self._stream is None:
            out = self._run(dict(batch))
        else:
            out = self._on_stream(batch, self._stream)
        self.batches += 1
        self.seconds += time.perf_counter() - t0
        return out

    def _on_stream(self, batch: Batch, stream: torch.cuda.Stream) -> Batch:
        dense = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        block, staged = pack_into(self.pool.acquire, dense)
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            state: dict[str, Any] = dict(batch)
            state.update({k: v.to(self.device, non_blocking=True) for k, v in staged.items()})
            out = self._run(state)
            done = torch.cuda.Event()
            done.record(stream)
        consumer.wait_event(done)
        for v in out.values():
            for t in (v.values, v.offsets, v.shapes) if isinstance(v, VarTensor) else (v,):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(consumer)  # made on the side stream, used on the consumer's
        self.pool.release(block, done)
        return out

    def stats(self) -> dict[str, Any]:
        """Batches executed, seconds spent (host side), images decoded each way, the codec
        and the pinned staging blocks held."""
        return {
            "batches": self.batches,
            "seconds": self.seconds,
            "decoder": self.ctx.decoder.name,
            "device_decodes": self.counts.device,
            "cpu_decodes": self.counts.cpu,
            "cpu_fallback_decodes": self.counts.cpu_fallback,
            "staging_blocks": self.pool.stats()["allocated"],
        }


def _var(im: Images) -> VarTensor:
    """Decoded images left at their own sizes, as a :class:`VarTensor` of ``[H, W, C]``."""
    sizes = im.hw[:, 0] * im.hw[:, 1] * im.c
    offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64, device=sizes.device)
    offsets[1:] = torch.cumsum(sizes, 0)
    c = torch.full((len(sizes), 1), im.c, dtype=torch.int64, device=sizes.device)
    return VarTensor(im.values, offsets, torch.cat([im.hw, c], 1))
