"""How transform failures are told: one internal exception carrying the facts, turned into
the wire's :class:`~shardserve.proto.errors.TransformError` with one message shape."""

from __future__ import annotations

from typing import Any

import numpy as np

from shardserve.proto.errors import TransformError


class StepFailed(Exception):
    """A step of a chain failed on one sample (``position`` in the batch) or on the batch
    (``position`` is ``None``). Crosses the worker-process boundary as plain JSON."""

    def __init__(
        self,
        transform: str,
        position: int | None,
        index: int | None,
        text: str,
        replaceable: bool = True,
    ) -> None:
        super().__init__(text)
        self.transform = transform
        self.position = position
        self.index = index
        self.text = text
        #: A sample transform's own exception may be replaced; a wrong output schema may not.
        self.replaceable = replaceable
        #: Every (position, index) of the batch this step raised on (``on_error="replace"``
        #: replaces them all at once); the first is this error's own.
        self.all: list[tuple[int, int]] = (
            [(position, index)] if position is not None and index is not None else []
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "transform": self.transform,
            "position": self.position,
            "index": self.index,
            "text": self.text,
            "replaceable": self.replaceable,
            "all": self.all,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepFailed:
        e = cls(d["transform"], d["position"], d["index"], d["text"], d["replaceable"])
        e.all = [(int(p), int(i)) for p, i in d.get("all", [])]
        return e


def transform_error(dataset: str, epoch: int, failed: StepFailed) -> TransformError:
    """The error a Loader sees: transform, dataset, sample index, exception text."""
    where = f"sample {failed.index}" if failed.index is not None else "a batch"
    return TransformError(
        f"transform {failed.transform!r} failed on dataset {dataset!r} {where} "
        f"(epoch {epoch}): {failed.text}"
    )


def pool_error(
    dataset: str, epoch: int, chain: list[str], indices: np.ndarray, what: str
) -> TransformError:
    """A worker hung or died: the chain, dataset and samples it was on."""
    shown = ", ".join(str(int(i)) for i in list(indices)[:8])
    more = f", ... ({len(indices)} in all)" if len(indices) > 8 else ""
    return TransformError(
        f"transform chain {chain} on dataset {dataset!r} samples {shown}{more} (epoch {epoch}): "
        f"{what}"
    )
