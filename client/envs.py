"""Several environments' batches per step from one streaming ``Loader``.

``Loader(..., envs=n)`` without ``resident`` asks for a job with ``envs=n`` and
``batch_size = n * b``: the server plans each environment on its own
(``SeedSequence([seed, epoch, e])``, environment 0 the job's own plan) and sends a step's
``n`` batches as one batch, env ``e`` in the ``e``-th of ``n`` equal parts of every field
(see ``shardserve.server.planning.envs``). One round trip, one gather and one message per
step, instead of ``n`` of each.

:func:`split_steps` cuts that batch into ``n`` batches; each tensor is copied into storage of
its own (on its environment's device), so no two environments, and no two fields, share
a storage: holding or saving one environment's labels keeps or writes nothing else. On the
CPU this costs no copy: each environment's rows of a field are a ``torch.from_numpy`` view of
their range of the batch's memory (:func:`._frames.own_storage`), and the slot goes back once
the last of them is gone (over the slot ring's usual lending; copied out instead while half
the ring is lent). On a GPU each environment's part is copied to its device.

Only fixed-shape fields can be cut into equal parts: variable and binary fields are refused
when the Loader is made, with the way out (``fields=[...]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from shardserve.proto.api import DatasetInfo
from shardserve.proto.errors import BadRequest

from ._cut import cut_rows
from ._frames import own_storage
from .types import Batch


def check_env_fields(info: DatasetInfo, fields: Sequence[str] | None) -> None:
    """Refuse (``BadRequest``) fields a step cannot be cut into environments by rows."""
    by_name = {str(f["name"]): f for f in info.fields}
    for name in list(fields) if fields is not None else list(by_name):
        f = by_name.get(name)
        if f is None:
            continue  # the server names unknown fields itself
        shape = [int(d) for d in f.get("shape", ())]  # type: ignore[attr-defined]
        if str(f["dtype"]) == "binary" or -1 in shape:
            raise BadRequest(
                f"envs>1 streams fixed-shape fields; {info.name!r} field {name!r} is "
                f"{f['dtype']}{shape}: leave it out with fields=[...]"
            )


def cut_steps(
    batch: Batch, rows: int, count: int, devices: Sequence[torch.device]
) -> list[list[Batch]]:
    """The ``count`` steps of one message (see :mod:`._cut`), each as its environments'
    batches, one per device of ``devices``. On the CPU, with every step full, each
    environment batch is cut straight out of the message (one view per field, not two)."""
    envs = len(devices)
    on_cpu = all(d.type == "cpu" for d in devices) and all(
        isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in batch.values()
    )
    first = next(iter(batch.values()), None)
    full = isinstance(first, torch.Tensor) and first.dim() > 0 and first.shape[0] == rows * count
    if on_cpu and full and rows % envs == 0:
        flat = cut_rows(batch, rows // envs, count * envs)
        return [flat[i * envs : (i + 1) * envs] for i in range(count)]
    return [split_steps(step, envs, devices) for step in cut_rows(batch, rows, count)]


def split_steps(
    batch: Mapping[str, object], envs: int, devices: Sequence[torch.device]
) -> list[Batch]:
    """The ``envs`` environment batches of one step, each tensor in storage of its own on
    ``devices[e]`` (see the module docstring)."""
    out: list[Batch] = [{} for _ in range(envs)]
    for name, t in batch.items():
        if not isinstance(t, torch.Tensor):
            raise BadRequest(
                f"envs>1: field {name!r} is not a fixed-shape tensor; leave it out with fields=[...]"
            )
        rows = t.shape[0]
        if rows % envs:
            raise BadRequest(
                f"step of {rows} rows in field {name!r} does not split into {envs} environments"
            )
        r = rows // envs
        if t.device.type == "cpu" and all(d.type == "cpu" for d in devices):
            # No copy: each env's rows become a tensor with a storage of its own over its
            # range of the batch's memory (own_storage), which keeps the slot (or block) held
            # until the last env tensor of the step is gone, as a whole batch would.
            for e in range(envs):
                out[e][name] = own_storage(t[e * r : (e + 1) * r])
            continue
        for e in range(envs):
            part, dev = t[e * r : (e + 1) * r], devices[e]
            # A fresh allocation per env and field: never a view of the slot or of another env.
            own = torch.empty(part.shape, dtype=part.dtype, device=dev)
            own.copy_(part, non_blocking=dev.type == "cuda")
            out[e][name] = own
    return out
