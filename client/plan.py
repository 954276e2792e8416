"""Index-only plans: the ids the server would stream, for data the trainer already holds.

A trainer that preloaded its dataset (GPU tensors, a NumPy array in RAM) needs no bytes from
the server, only the order: which sample ids make each batch of each epoch for its rank, the
same on every machine, resumable mid-epoch. [plan][shardserve.client.plan.plan] asks the
server for exactly that (``GET /v1/jobs/{id}/plan``, one request per epoch and environment)
and hands out the ids batch by batch:

```python
ids = plan("http://127.0.0.1:7070", "cifar10", 256, seed=0, device="cuda")
for epoch in range(10):
    ids.set_epoch(epoch)
    for batch_ids in ids:  # int64 [B] on the device
        x = images.index_select(0, batch_ids)  # images preloaded there
```

The job is the one a ``Loader`` with the same arguments streams (same spec, same job id), so
the ids are the samples that Loader would deliver, in its order; ``state_dict()`` is a
Loader's state, and either resumes from the other's. ``envs=n`` yields a list of ``n`` id
batches per step, environment ``e`` from its own plan (``SeedSequence([seed, epoch, e])`` on
the server; environment 0 is the job's own plan): the job of ``Loader(envs=n)``, whose steps
the server plans as the environments' batches side by side.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shardserve.proto.errors import BadRequest, DataError
from shardserve.proto.jobs import CollateArg, EnvShuffle, OnError

from ._position import Position, Start
from .device import resolve_device
from .device_steps import with_device_steps
from .distributed import World, resolve_world
from .job import JobArgs, JobHandle, Shuffle
from .mixture import Mixture
from .state import check_resumable, make_state, parse_states, start_for

IdBatch = torch.Tensor


class IndexPlan:
    """Batches of sample ids of one job for one rank (see the module docstring and
    [plan][shardserve.client.plan.plan]).

    Each step yields an int64 tensor ``[B]`` on ``device`` (a list of ``envs`` of them when
    ``envs > 1``). The tensors of one epoch are views of that epoch's id tensor: read them,
    do not write into them. Epochs behave as a ``Loader``'s: ``set_epoch`` picks the next
    iteration's epoch; without it a new plan starts at the job's epoch and ``iter()`` moves on
    only after a pass that yielded.
    """

    def __init__(
        self, job: JobHandle, world: World, envs: int, device: torch.device, timeout: float
    ) -> None:
        """Use :func:`plan`, which creates the job from a Loader's arguments."""
        self._job: JobHandle | None = job
        self.spec, self.world = job.spec, world
        self.envs, self.device, self.timeout = envs, device, timeout
        self._pos = Position(job.epoch, job.batches_per_epoch)
        self._pass = 0

    @property
    def job_id(self) -> str:
        """The server's id of the job (it covers the dataset version the job pinned)."""
        return self._live().id

    def _live(self) -> JobHandle:
        if self._job is None:
            raise RuntimeError("this plan is closed")
        return self._job

    # -- the ids -----------------------------------------------------------------------------
    def epoch_ids(self, epoch: int, env: int = 0) -> np.ndarray:
        """Every id of this rank's ``epoch`` (environment ``env``) in batch order, int64."""
        if not 0 <= env < self.envs:
            raise BadRequest(f"env {env} out of range 0 <= env < {self.envs}")
        return (
            np.concatenate([s[env] for s in self._steps(epoch, 0)])
            if len(self)
            else np.empty(0, np.int64)
        )

    def _steps(self, epoch: int, offset: int) -> list[list[np.ndarray]]:
        """Each step's id batch per environment (one request: a step is the envs' batches
        side by side, env ``e`` the ``e``-th of ``envs`` equal parts); ``offset``: the plan
        dealt from there (an elastic resume)."""
        job = self._live()
        ids, batches = job.api.plan(
            job.id, epoch, self.world.rank, timeout=self.timeout, offset=offset
        )
        want = -(-len(ids) // self.spec.batch_size)
        if want != batches:
            raise DataError(
                f"plan of job {self.job_id} epoch {epoch}: {len(ids)} ids make {want} "
                f"steps of {self.spec.batch_size}, the server said {batches}"
            )
        self._pos.num_batches = batches
        steps = np.split(ids, np.arange(self.spec.batch_size, len(ids), self.spec.batch_size))
        return [np.split(step, self.envs) for step in steps if len(step)]

    def _epoch_batches(self, epoch: int, offset: int) -> list[list[IdBatch]]:
        steps = self._steps(epoch, offset)
        flat = torch.from_numpy(
            np.concatenate([i for s in steps for i in s]) if steps else np.empty(0, np.int64)
        )
        sizes = [len(i) for s in steps for i in s]
        parts = iter(flat.to(self.device).split(sizes))
        return [[next(parts) for _ in range(self.envs)] for _ in steps]

    # -- epochs and resume (a Loader's rules and state) --------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration plans; a position restored for it is kept."""
        self._pos.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches (steps) per epoch for this rank."""
        return self._pos.num_batches

    def state_dict(self) -> dict[str, Any]:
        """The epoch in progress and the next step not yet received (a ``Loader`` state)."""
        return make_state(
            self.spec.model_dump(mode="json"),
            self.job_id,
            self.world.rank,
            self.world.world_size,
            self._pos.state(),
            self._live().versions,
        )

    def load_state_dict(
        self, state: dict[str, Any] | list[dict[str, Any]], *, allow_other_version: bool = False
    ) -> None:
        """Start the next iteration where ``state`` (this plan's or a ``Loader``'s, of any
        world size, or a list of every rank's) left off; a ``Loader``'s rules, and its
        ``allow_other_version``."""
        st = parse_states(state)
        job = self._live()
        check_resumable(
            st, self.spec, job.pinned, self.world.world_size, "plan", allow_other_version
        )
        start, _ = start_for(st, self.world.world_size, job.num_samples, self._pos.per_epoch)
        self._pos.restore(*start)

    def __iter__(self) -> Iterator[Any]:
        self._live()
        start = self._pos.next_start()
        self._pos.begin(start)
        self._pass += 1
        return self._run(self._pass, start)

    def _run(self, this_pass: int, start: Start) -> Iterator[Any]:
        steps = self._epoch_batches(start.epoch, start.offset)
        for i in range(start[1], len(steps)):
            if self._pass != this_pass:
                raise RuntimeError("this iterator was replaced by a newer iter(plan); use that one")
            self._pos.received(start, i)
            yield steps[i] if self.envs > 1 else steps[i][0]
        self._pos.ended(start)

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close the HTTP client; idempotent."""
        job, self._job = self._job, None
        if job is not None:
            job.close()

    def __enter__(self) -> IndexPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_job", None) is not None:
            self.close()

    def __repr__(self) -> str:
        return (
            f"IndexPlan(dataset={self.spec.dataset!r}, rank={self.world.rank}/"
            f"{self.world.world_size}, "
            f"envs={self.envs}, epoch={self._pos.epoch})"
        )


def plan(
    url: str | None,
    dataset: str | Mixture,
    batch_size: int,
    *,
    seed: int = 0,
    shuffle: Shuffle = True,  # a literal, so the API page shows it; the Loader's is the same
    drop_last: bool = False,
    fields: Sequence[str] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    envs: int = 1,
    env_shuffle: EnvShuffle = "independent",
    device: str | torch.device = "cpu",
    timeout: float = 60.0,
    token: str | None = None,
    collate: CollateArg | None = None,
    transforms: Sequence[Mapping[str, Any]] | None = None,
    on_error: OnError | None = None,
    epoch_samples: int | None = None,
    device_transforms: Sequence[Mapping[str, Any]] | None = None,
) -> IndexPlan:
    """The sample ids a ``Loader`` with these arguments would stream, batch by batch (see the
    module docstring): an [IndexPlan][shardserve.client.plan.IndexPlan] to iterate, ``set_epoch``
    and resume.

    Every argument that defines a Loader's job is accepted here with the Loader's meaning
    and default (see [Loader][shardserve.client.Loader]); the ones about delivery (``prefetch``,
    ``transport``, ``copy``, ``pad_variable``, ``resident``, ``share``) have no use for ids.
    ``transforms`` do not change which samples a batch holds (``on_error="replace"``
    replaces samples inside the server, after the plan), but they are part of the job: with
    them the ids are those of the Loader's job, and a state dict passes between the two.
    A mixture's ids run over its datasets concatenated in order (dataset ``k``'s sample ``i``
    is ``i`` plus the sizes of the datasets before it).

    ```python
    ids = plan(None, "cifar10", 256, seed=0)
    next(iter(ids)).shape  # torch.Size([256])
    ```
    """
    world = resolve_world(rank, world_size)
    spec = JobArgs(
        dataset=dataset,
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        drop_last=drop_last,
        fields=fields,
        collate=collate,
        envs=envs,
        env_shuffle=env_shuffle,
        transforms=transforms,
        on_error=on_error,
        epoch_samples=epoch_samples,
    ).spec(world.world_size)
    spec = with_device_steps(spec, device_transforms) if device_transforms is not None else spec
    dev = resolve_device(device, world.local_rank)
    job = JobHandle.create(url, token, spec, timeout=timeout, world=world)
    return IndexPlan(job, world, envs, dev, timeout)
