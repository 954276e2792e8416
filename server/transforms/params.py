"""The base of every built-in transform's parameters: strict, bounded, named in errors.

A job's parameters are checked when the job is created, so nonsense is a 422 naming the
parameter, never a failure at stream time.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

#: A field name a transform reads or writes.
Name = Annotated[str, Field(min_length=1, max_length=256)]


class FieldParams(BaseModel):
    """Parameters of a transform of one field (``field``, default ``"image"``)."""

    # Strict: "32" is not 32 and true is not 1; floats are finite.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    #: The field to transform.
    field: Name = "image"
