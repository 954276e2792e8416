"""What a Loader decides from its arguments before it has a job: whether resident mode can
serve them, and where its environments live (so how many environments its job's batch holds)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import EnvShuffle

from .distributed import World
from .mixture import Mixture
from .resident import env_devices, stream_env_devices

ResidentMemory = Literal["cuda", "cpu"]


def check_resident_args(
    resident: ResidentMemory | None,
    dataset: str | Mixture,
    transforms: Sequence[Mapping[str, Any]] | None,
    share: str | None,
) -> None:
    """Refuse what resident mode cannot do: a mixture, transforms, a share group."""
    if resident is None:
        return
    if not isinstance(dataset, str):
        raise BadRequest(
            "a mixture (dataset={name: weight}) streams batches: it cannot be resident "
            "(yet); leave resident out"
        )
    if transforms is not None:
        raise BadRequest("resident mode holds the stored fields; it cannot run transforms")
    if share is not None:
        raise BadRequest(
            "resident mode gathers in this process: there is no server pass to share; "
            "leave share or resident out"
        )


@dataclass(frozen=True)
class EnvPlaces:
    """Where a Loader's environments live, and so how many its job's batch holds."""

    #: The device of each environment in resident mode (empty when streaming).
    resident: list[torch.device]
    #: The device of each environment of a streamed step (empty: one environment, or resident).
    step: list[torch.device]
    #: Environments per batch of the job: a step's when streaming; resident environments
    #: gather from plans of a one-environment job, unless they split one shuffle, which the
    #: job must deal.
    job_envs: int

    @classmethod
    def of(
        cls,
        resident: ResidentMemory | None,
        envs: int,
        devices: Sequence[str | torch.device] | None,
        env_shuffle: EnvShuffle,
        device: torch.device,
        world: World,
    ) -> EnvPlaces:
        """The places of ``envs`` environments of a Loader with these arguments."""
        on = env_devices(resident, envs, devices, device, world.local_rank)
        # Streaming envs: one job whose batches are steps of `envs` env batches.
        step = (
            stream_env_devices(envs, devices, device, world.local_rank)
            if resident is None and envs > 1
            else []
        )
        return cls(on, step, envs if step or env_shuffle == "split" else 1)
