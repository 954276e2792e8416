"""The mixture parts of a job spec: a source and its weight, a weight change from a step on,
and the name a mixture job goes by. Re-exported by :mod:`.jobs`, whose ``JobSpec`` holds them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .manifest import validate_dataset_name

#: What a mixture source does when its samples run out within an epoch: wrap into a new
#: permutation of its own, or end the epoch.
Exhaustion = Literal["repeat", "stop"]

#: Most sources of one mixture (source ids travel as int16; the planner labels as uint8).
MAX_MIXTURE_SOURCES = 64
#: Most weight changes a job may carry, in its spec and set later together.
MAX_SCHEDULE = 1024
#: A mixture job's ``dataset`` starts with this: it names the mixture, not a dataset.
MIXTURE_PREFIX = "mix:"


class MixtureSource(BaseModel):
    """One dataset of a mixture and its weight: the probability (after normalising the
    weights) that a batch position draws from it.

    >>> MixtureSource(name="web", weight=0.7).on_exhausted
    'repeat'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    weight: float = Field(ge=0, allow_inf_nan=False)
    #: ``"repeat"``: wrap into a new permutation of this source; ``"stop"``: end the epoch
    #: when it runs out.
    on_exhausted: Exhaustion = "repeat"
    #: Pinned by the server at creation, as ``JobSpec.version``; clients leave it out.
    version: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        try:
            return validate_dataset_name(v)
        except ValueError as e:
            raise ValueError(str(e)) from None


def check_weights(weights: tuple[float, ...], n_sources: int, what: str) -> tuple[float, ...]:
    """``weights`` if there is one per source, each finite and >= 0, summing to more than 0.

    >>> check_weights((1.0, 0.0), 2, "weights")
    (1.0, 0.0)
    """
    if len(weights) != n_sources:
        raise ValueError(f"{what} has {len(weights)} weights for {n_sources} sources")
    for k, w in enumerate(weights):
        if not (w >= 0 and w < float("inf")):
            raise ValueError(f"{what}[{k}] = {w} must be a finite number >= 0")
    total = sum(weights)
    if not 0 < total < float("inf"):
        raise ValueError(
            f"{what} sum to {total}: at least one weight must be > 0, and their sum finite"
        )
    return weights


class WeightChange(BaseModel):
    """From global step ``at_step`` on (``epoch * batches_per_epoch + batch``), the mixture's
    weights are ``weights``, one per source in the order of ``JobSpec.mixture``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    at_step: int = Field(ge=0, lt=1 << 62)
    weights: tuple[float, ...] = Field(min_length=1, max_length=MAX_MIXTURE_SOURCES)


def mixture_label(names: tuple[str, ...] | list[str]) -> str:
    """The ``dataset`` of a mixture job: ``mix:`` and its sources' names.

    >>> mixture_label(["web", "code"])
    'mix:web+code'
    """
    label = MIXTURE_PREFIX + "+".join(names)
    if len(label) > 128:
        label = f"{MIXTURE_PREFIX}{names[0][:80]}+{len(names) - 1}-more"
    return label
