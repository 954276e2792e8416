"""``GET /v1/transforms``: the transforms jobs may name here, their parameters (JSON Schema)
and output fields, and how the pool that runs them is doing."""

from __future__ import annotations

import html
from typing import Any

from fastapi import APIRouter

from ..service import Service
from .deps import Authorized, ServiceDep

router = APIRouter(prefix="/v1/transforms", tags=["transforms"], dependencies=Authorized)


@router.get("")
def list_transforms(service: ServiceDep) -> dict[str, Any]:
    """Installed transforms (``transforms``), the pool (``pool``) and counts since start."""
    return service.describe_transforms()


def status_section(service: Service) -> str:
    """The status page's transform section: pool, throughput, time per transform, errors and
    replacements since start (nothing until a job ran a transform)."""
    d = service.describe_transforms()
    c, pool = d["counts"], d["pool"]
    if not c.get("batches") and not c.get("errors"):
        return ""
    seconds = c.get("seconds", {})
    busy = sum(seconds.values())
    rate = f"{c.get('samples', 0) / busy:,.0f}" if busy else "—"
    in_place = (
        f" · inputs workers read from shared memory "
        f"{c.get('worker_input_bytes_via_shm', 0) / 2**20:,.1f} MiB"
        f" · outputs workers wrote into streams' shared memory "
        f"{c.get('worker_bytes_in_place', 0) / 2**20:,.1f} MiB"
        if pool["processes"]
        else ""
    )
    per = " · ".join(
        f"{html.escape(k)} {v / max(c.get('batches', 1), 1) * 1000:.2f} ms/batch"
        for k, v in sorted(seconds.items())
    )
    return (
        f"<h2>transforms</h2><p class='meta' id='transforms'>pool {pool['kind']} × {pool['size']}"
        f" · worker processes {pool['processes']} · waiting for a worker {pool['waiting']}"
        f" · samples {c.get('samples', 0)} · batches {c.get('batches', 0)}"
        f" · samples/s of transform time {rate} · errors {c.get('errors', 0)}"
        f" · replaced {c.get('replaced', 0)} · workers hung {c.get('workers_hung', 0)}"
        f" · workers died {c.get('workers_died', 0)}{in_place}</p><p class='meta'>{per}</p>"
    )
