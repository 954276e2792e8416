"""Mixtures from the client side: the spec a ``{name: weight}`` mapping makes, and the step a
weight change takes effect at when every DDP rank asks for it.

Each rank sends the same change; the server takes it once. A change needs a step that every
rank agrees on without talking to the others: an explicit ``at_step`` (a global step,
``epoch * batches_per_epoch + batch``), or by default the first step of the next epoch, which
no rank has been sent yet.

>>> [(s.name, s.weight) for s in mixture_sources({"web": 0.7, "code": 0.3})]
[('web', 0.7), ('code', 0.3)]
>>> next_epoch_step(epoch=2, batches_per_epoch=100)
300
"""

from __future__ import annotations

from collections.abc import Mapping

from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import MixtureSource

__all__ = ["mixture_sources", "next_epoch_step"]


def mixture_sources(weights: Mapping[str, float]) -> tuple[MixtureSource, ...]:
    """The ``JobSpec.mixture`` of ``{dataset name: weight}``, in the mapping's order."""
    if not weights:
        raise BadRequest("a mixture needs at least one dataset: {name: weight, ...}")
    try:
        return tuple(MixtureSource(name=n, weight=float(w)) for n, w in weights.items())
    except ValueError as e:
        raise BadRequest(f"mixture {dict(weights)}: {e}") from None


def next_epoch_step(epoch: int, batches_per_epoch: int) -> int:
    """The global step that starts the epoch after ``epoch``: the default ``at_step``."""
    return (epoch + 1) * batches_per_epoch
