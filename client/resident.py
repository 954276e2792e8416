"""Resident mode: the dataset held once in the trainer's device (or host) memory.

``Loader(..., resident="cuda")`` streams the dataset's fields once, in store order, through
the server (a ``shuffle="none"`` job of world size 1, so the shards the server serves were
checksummed by its ``--verify`` policy), into one tensor per field on each device that needs
them. After that the server sends only plans: per epoch, ``GET /v1/jobs/{id}/plan`` returns
the rank's sample ids in batch order (the very ids the data plane would stream), and each
batch is one ``index_select`` per field into a fresh allocation, so no two batches (and no
two environments) share storage. The plan, the order and ``state_dict`` are the streaming
mode's.

Environments (the PPO case): ``envs=n`` hands out ``n`` batches a step, environment ``e``
from its own plan (``SeedSequence([seed, epoch, e])`` on the server; environment 0 is the
job's own plan), each on its device from ``devices``; with ``env_shuffle="split"`` the
plans are the parts of one shuffle (a job of ``envs=n``, see ``JobSpec.env_shuffle``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardserve.proto.api import DatasetInfo, JobStatus
from shardserve.proto.errors import BadRequest, DataError, ProtocolError
from shardserve.proto.jobs import MAX_ENVS, rank_plan_size

from ._frames import torch_dtype
from .control import ControlClient
from .device import resolve_device
from .types import Batch, VarTensor

#: Resident data may take at most this share of the memory free on its device.
FIT_SHARE = 0.9

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


class ResidentTooLarge(BadRequest):
    """The dataset's fields do not fit in the memory free on the resident device."""


def env_devices(
    resident: str | None,
    envs: int,
    devices: Sequence[str | torch.device] | None,
    device: torch.device,
    local_rank: int,
) -> list[torch.device]:
    """The device of every environment in resident mode; empty when streaming."""
    if not 1 <= envs <= MAX_ENVS:
        raise BadRequest(f"envs={envs} is out of range 1 <= envs <= {MAX_ENVS}")
    if resident is None:
        return []  # streaming: client/envs.py cuts each step into its environments
    if resident not in ("cuda", "cpu"):
        raise BadRequest(f"resident={resident!r}: use 'cuda', 'cpu' or None (streaming)")
    default = device if device.type == resident else torch.device(resident)
    resolved = [resolve_device(d, local_rank) for d in (devices or [default])]
    wrong = [str(d) for d in resolved if d.type != resident]
    if wrong:
        raise BadRequest(f"devices {wrong} do not match resident={resident!r}")
    return [resolved[e % len(resolved)] for e in range(envs)]


def stream_env_devices(
    envs: int, devices: Sequence[str | torch.device] | None, device: torch.device, local_rank: int
) -> list[torch.device]:
    """The device of every environment when streaming: ``devices[e % len]``, else ``device``."""
    resolved = [resolve_device(d, local_rank) for d in (devices or [device])]
    return [resolved[e % len(resolved)] for e in range(envs)]


def field_layout(info: DatasetInfo, fields: Sequence[str] | None) -> Layout:
    """dtype and per-sample shape of every resident field; variable or binary fields refuse."""
    by_name = {str(f["name"]): f for f in info.fields}
    names = list(fields) if fields is not None else list(by_name)
    layout: Layout = {}
    for name in names:
        f = by_name[name]
        dtype, shape = str(f["dtype"]), tuple(int(d) for d in f.get("shape", ()))  # type: ignore[attr-defined]
        if dtype == "binary" or -1 in shape:
            raise BadRequest(
                f"resident mode holds fixed-shape fields; {info.name!r} field {name!r} is "
                f"{dtype}{list(shape)}: leave it out with fields=[...] or use the streaming mode"
            )
        if f.get("nullable"):
            # Its mask would not be held: missing samples would read as made-up zeros.
            raise BadRequest(
                f"resident mode holds fields with a value in every sample; {info.name!r} field "
                f"{name!r} is missing in some: leave it out with fields=[...] or use the "
                "streaming mode (it delivers the mask)"
            )
        layout[name] = (torch_dtype(dtype), shape)
    return layout


def resident_nbytes(layout: Layout, num_samples: int) -> int:
    """Bytes the fields of ``num_samples`` samples take on one device."""
    per_sample = sum(
        math.prod(shape) * torch.empty((), dtype=dt).element_size() for dt, shape in layout.values()
    )
    return per_sample * num_samples


def free_bytes(device: torch.device) -> int:
    """Memory free for new allocations on ``device`` (``MemAvailable`` for the host)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")  # pragma: no cover - Linux only


def check_fits(dataset: str, need: int, devices: Iterable[torch.device]) -> None:
    """Refuse before allocating when ``need`` bytes exceed the share of memory free."""
    for dev in devices:
        free = free_bytes(dev)
        if need > FIT_SHARE * free:
            raise ResidentTooLarge(
                f"dataset {dataset!r} needs {need / 2**20:,.1f} MiB resident on {dev}, but only "
                f"{free / 2**20:,.1f} MiB is free there (at most {FIT_SHARE:.0%} is used): pick "
                "fewer fields with fields=[...], use resident='cpu', or leave resident unset "
                "to stream batches"
            )


@dataclass
class ResidentFields:
    """One device's copy of the dataset: a tensor ``[num_samples, *shape]`` per field."""

    device: torch.device
    tensors: dict[str, torch.Tensor]

    def gather(self, ids: torch.Tensor) -> Batch:
        """The samples ``ids`` (on this device), each field in storage of its own."""
        return {name: t.index_select(0, ids) for name, t in self.tensors.items()}


def load_fields(
    batches: Iterable[Mapping[str, torch.Tensor | VarTensor]],
    layout: Layout,
    num_samples: int,
    devices: Sequence[torch.device],
) -> dict[torch.device, ResidentFields]:
    """Copy a store-order pass over the dataset into one tensor per field on each device."""
    out = {
        dev: ResidentFields(
            dev,
            {
                n: torch.empty((num_samples, *s), dtype=dt, device=dev)
                for n, (dt, s) in layout.items()
            },
        )
        for dev in devices
    }
    pos = 0
    for batch in batches:
        parts = {name: _fixed(batch, name) for name in layout}
        size = next(iter(parts.values())).shape[0] if parts else 0
        if pos + size > num_samples:
            raise DataError(f"loading resident data: server sent more than {num_samples} samples")
        for res in out.values():
            for name, part in parts.items():
                res.tensors[name][pos : pos + size].copy_(part)
        pos += size
    if pos != num_samples:
        raise DataError(f"loading resident data: server sent {pos} of {num_samples} samples")
    for dev in devices:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    return out


def _fixed(batch: Mapping[str, torch.Tensor | VarTensor], name: str) -> torch.Tensor:
    part = batch[name]
    if not isinstance(part, torch.Tensor):  # field_layout refused variable fields
        raise DataError(f"loading resident data: field {name!r} arrived variable-shaped")
    return part


@dataclass
class EnvPlan:
    """One environment's ids of one epoch on its device, cut into batches (views)."""

    batches: tuple[torch.Tensor, ...]
    data: ResidentFields

    @property
    def num_batches(self) -> int:
        return len(self.batches)

    def batch(self, i: int) -> Batch:
        return self.data.gather(self.batches[i])


class Resident:
    """The resident data of one Loader and the plans it gathers by."""

    def __init__(
        self,
        api: ControlClient,
        job_id: str,
        rank: int,
        batch_size: int,
        data: dict[torch.device, ResidentFields],
        env_devices: Sequence[torch.device],
        timeout: float,
    ) -> None:
        self.api, self.job_id, self.rank, self.batch_size = api, job_id, rank, batch_size
        self.data, self.env_devices, self.timeout = data, list(env_devices), timeout
        self._job: JobStatus | None = None  # the server's word on the job, asked once
        #: ``(epoch, job id)``: the job of another world size whose state was resumed from
        #: that epoch on (a mixture's steps keep that job's places), else ``None``.
        self.origin: tuple[int, str] | None = None

    @classmethod
    def load(
        cls,
        api: ControlClient,
        job_id: str,
        rank: int,
        batch_size: int,
        info: DatasetInfo,
        layout: Layout,
        env_devices: Sequence[torch.device],
        stream_once: Callable[[], Iterable[Batch]],
        timeout: float,
    ) -> Resident:
        """Check the fields of ``layout`` (see :func:`field_layout`) fit on every device of
        ``env_devices``, then load them through ``stream_once`` (a store-order pass)."""
        devices = list(dict.fromkeys(env_devices))
        check_fits(info.name, resident_nbytes(layout, info.num_samples), devices)
        data = load_fields(stream_once(), layout, info.num_samples, devices)
        return cls(api, job_id, rank, batch_size, data, env_devices, timeout)

    def add_field(self, name: str, rows: torch.Tensor) -> None:
        """Hold ``rows`` (one value a resident sample) as field ``name`` on every device: a
        part the server adds to each batch (a mixture's ``source``), not a stored field."""
        for fields in self.data.values():
            fields.tensors[name] = rows.to(fields.device)

    @property
    def sample_nbytes(self) -> int:
        """Bytes one sample's fields take."""
        first = next(iter(self.data.values()))
        return sum(t[0].numel() * t.element_size() for t in first.tensors.values())

    def epoch(self, epoch: int, offset: int = 0) -> list[EnvPlan]:
        """Every environment's plan for ``epoch`` (dealt from ``offset``: an elastic resume),
        its ids already on its device."""
        plans = []
        origin = self.origin[1] if self.origin and self.origin[0] <= epoch else ""
        for env, dev in enumerate(self.env_devices):
            ids, batches = self.api.plan(
                self.job_id,
                epoch,
                self.rank,
                env,
                timeout=self.timeout,
                offset=offset,
                take=True,
                origin=origin,
            )
            what = f"plan of job {self.job_id} epoch {epoch} env {env}"
            self._check_plan(ids, batches, what, offset)
            cut = torch.from_numpy(ids.copy()).to(dev).split(self.batch_size)
            plans.append(EnvPlan(cut, self.data[dev]))
        return plans

    def _check_plan(self, ids: np.ndarray, batches: int, what: str, offset: int = 0) -> None:
        """Refuse a plan before any id reaches a device: its length must be the job's (every
        rank plans the same number of ids, see :func:`~shardserve.proto.jobs.rank_plan_size`)
        and every id a row of the resident data (on CUDA an id out of range is a device-side
        assert, not an error). A violation is a :class:`ProtocolError` naming the field."""
        if self._job is None:
            self._job = self.api.job(self.job_id, timeout=self.timeout)
        spec, rows = self._job.spec, self.num_samples
        want_ids, want_batches = rank_plan_size(
            self._job.num_samples - offset, spec.deal_world, self.batch_size, spec.drop_last
        )
        # A mixture's epoch is as long as it asks, over rows of every source.
        if spec.mixture is None and self._job.num_samples != rows:
            raise ProtocolError(
                f"job {self.job_id} field num_samples={self._job.num_samples}, but the "
                f"resident data holds {rows} samples"
            )
        # An epoch that ends when a "stop" source runs out is as long as its weights make it.
        short = spec.ends_early and batches <= want_batches and len(ids) <= want_ids
        if not short and (batches != want_batches or len(ids) != want_ids):
            raise ProtocolError(
                f"{what}: {len(ids)} ids in {batches} batches (header "
                f"X-Shardserve-Num-Batches), but the job plans {want_ids} ids in "
                f"{want_batches} batches of {self.batch_size} for each of its "
                f"{spec.world_size} ranks"
            )
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            bad = int(np.flatnonzero((ids < 0) | (ids >= rows))[0])
            raise ProtocolError(
                f"{what}: id {int(ids[bad])} (batch {bad // self.batch_size}) is out of range "
                f"0 <= id < {rows}"
            )

    @property
    def num_samples(self) -> int:
        """Samples the resident data holds."""
        first = next(iter(self.data.values()))
        return int(next(iter(first.tensors.values())).shape[0]) if first.tensors else 0

    def close(self) -> None:
        self.data.clear()
