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

from collections.abc import Mapping, Sequence

from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import MixtureSource

__all__ = ["Mixture", "mixture_sources", "next_epoch_step"]


#: A mixture as a Loader takes it: ``{name: weight}``, or sources with more to say
#: (``MixtureSource(name, weight, on_exhausted="stop")`` or the same as dicts).
Mixture = Mapping[str, float] | Sequence[MixtureSource | Mapping[str, object]]


def mixture_sources(weights: Mixture) -> tuple[MixtureSource, ...]:
    """The ``JobSpec.mixture`` of ``{dataset name: weight}`` (in the mapping's order) or of
    a list of sources.

    >>> [s.on_exhausted for s in mixture_sources([{"name": "a", "weight": 1, "on_exhausted": "stop"}])]
    ['stop']
    """
    if not weights:
        raise BadRequest("a mixture needs at least one dataset: {name: weight, ...}")
    try:
        if isinstance(weights, Mapping):
            return tuple(MixtureSource(name=n, weight=float(w)) for n, w in weights.items())
        return tuple(MixtureSource.model_validate(s) for s in weights)
    except ValueError as e:
        raise BadRequest(f"mixture {weights!r}: {e}") from None


def next_epoch_step(epoch: int, batches_per_epoch: int) -> int:
    """The global step that starts the epoch after ``epoch``: the default ``at_step``."""
    return (epoch + 1) * batches_per_epoch
