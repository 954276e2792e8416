"""A transform module that loads in the server but raises when a transform worker process
imports it (as one whose dependency is missing from the workers' environment would)."""

from __future__ import annotations

import multiprocessing
from typing import Any

from shardserve.server.transforms import Field, sample_transform

if multiprocessing.current_process().name == "ss-transform":
    raise ImportError("worker_refuses does not load in a transform worker process")


@sample_transform(outputs={"label": Field("int64", ())}, pool="process")
def same_label(sample: dict[str, Any], params: Any, rng: Any) -> dict[str, Any]:
    """The label as it is."""
    return {"label": sample["label"]}
